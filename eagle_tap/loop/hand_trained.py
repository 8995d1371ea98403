"""`eagle-tap loop promote`: a draft trained outside the loop (`eagle-tap train` on a team's own GPUs, exported)
rolled out through the loop's gate, canary, verification and rollback.

1. Checked before anything is written: the folder is an exported draft that can take the promoted version's
   place in the replicas (`trainer.draft_fit`: the same architecture and sizes, aux layer ids, `d2t`/`t2d`
   and tensor shapes) and was made for the loop's target. A draft that fails any of these is refused with the
   difference named; no registry object and no replica is touched.
2. Judged as a round's candidate is (`rounds.gate`), against the promoted version: `eagle-tap eval`'s served
   walk at the replicas' chain length on the newest `num_records` records of the shard set (the traffic the
   replicas serve now; the loop cannot know which records a hand-trained draft saw, so these are not held
   out from it) and on the regression set.
3. Stored as the next version (`made.how` says where it came from, with the evaluation and the simulated probe);
   a draft that fails the gate is marked `rejected`, unless `force`, which is recorded in the version and the
   `gate` event; a draft that passes (or is forced) is promoted exactly as a round's: canary first
   (`Loop.promote`).

What must hold: the registry's lock is taken (one loop per registry: a running `loop run` must be stopped
first, and it takes the promoted version up again when started); a refused draft leaves the registry as it was.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle_tap.loop.registry import RegistryError
from eagle_tap.loop.rounds import judge, shard_entries
from trainer.draft_fit import check_draft_fits, in_place_of

__all__ = ["DEFAULT_NUM_RECORDS", "promote_hand_trained"]

DEFAULT_NUM_RECORDS = 64
"""Newest records of the shard set the hand-trained draft and the promoted version are judged on."""


def promote_hand_trained(loop: Any, draft_dir: str | Path, *, force: bool = False,
                         num_records: int = DEFAULT_NUM_RECORDS) -> dict[str, Any]:
    """Steps 1-3 of the module docstring on a Loop that holds the registry; what happened, as a dict with
    `state` (`rejected`, or the promotion's: `promoted`, `rolled_back`, `promoting`) and `why`."""
    draft_dir = Path(draft_dir)
    registry, config = loop.registry, loop.config
    promoted = registry.state()["promoted"]
    if promoted is None:
        raise RegistryError(f"{registry.url} has no promoted version: run `eagle-tap loop init` first")
    if num_records < 1:
        raise ValueError(f"num_records must be at least 1; got {num_records}")
    promoted_dir = registry.local_copy(promoted)
    check_draft_fits(draft_dir, **in_place_of(promoted_dir, used_as=f"the promoted version {promoted}"),
                     target_dir=config.target)
    entries = shard_entries(config.shards)[-num_records:]
    if not entries:
        raise ValueError(f"{config.shards} holds no record to judge {draft_dir} on")
    record_ids = [entry.record_id for entry in entries]
    loop.say(f"judging {draft_dir} against {promoted} on the newest {len(record_ids)} records of {config.shards}")
    evaluation = judge(loop, draft_dir, promoted_dir, record_ids)
    passed, why = evaluation["gate"]["passed"], evaluation["gate"]["why"]
    forced = force and not passed
    evaluation["gate"].update(forced=forced,
                              records="the newest of the shard set, not held out from a hand-trained draft")
    made = {"how": "hand-trained, registered by `eagle-tap loop promote`", "source": str(draft_dir),
            "judged_on_records": len(record_ids), "forced": forced}
    version = registry.add_version(draft_dir, parent=promoted, made=made, evaluation=evaluation)
    registry.set_version_info(version.name, probe=loop.simulate_probe(draft_dir))
    registry.event("gate", version=version.name, passed=passed, forced=forced, why=why,
                   hand_trained=str(draft_dir))
    if not passed and not force:
        registry.set_version_state(version.name, "rejected", why)
        loop.say(f"{version.name} ({draft_dir}) fails the gate: {why}")
        return {"version": version.name, "state": "rejected", "why": why, "evaluation": evaluation}
    loop.say(f"{version.name} ({draft_dir}) {'passes the gate' if passed else 'is forced past the gate'}: {why}")
    return {**loop.promote(version.name), "evaluation": evaluation, "forced": forced}
