"""The loop's rounds, offline (no SGLang server: replicas=[]), on shards built with HF transformers on the tiny model.

Each test has its own registry and shard folder: the shards of conversations 0-63 (what
tests/test_trainer_export.py's trained_run trained on) are copied in, the export of that run is registered as
v0001 with those records as round r0000, and new records are written into the same folder with capture_format's
own shard writer (shard numbers after the copied ones, so store order is arrival order).

Rounds: the count trigger (and not before it), the newest records held out, training on new + replay records,
a version stored with its parent, how it was made and its evaluation, the gate forced both ways by gate_margin,
a promotion that no replica can answer kept pending; the age trigger; coverage too low; a candidate left by a
stopped loop abandoned and its records new again. The registry on an object store (moto): versions, checked
copies, state, events, the lease. Watch: served_draft metadata pooled into one window per tick, never counted
twice by a restarted loop.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest

import capture_format as cf
from eagle_tap.cli import main
from eagle_tap.loop import rounds
from eagle_tap.loop.registry import LOCK_FILE, Registry, RegistryError, RegistryLocked
from eagle_tap.loop.run import Loop, LoopConfig

sys.path.insert(0, str(Path(__file__).parent))
import trainer_data  # noqa: E402
from test_object_store import new_bucket, s3  # noqa: E402,F401  (fixture: a moto S3 server)

TRAIN_STEPS = 5


# ------------------------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The tiny model's inputs, the export of trained_run() (the first version) and a small regression set."""
    from test_trainer_export import trained_run

    inputs = trainer_data.prepared_inputs()
    export = tmp_path_factory.mktemp("first") / "draft"
    assert main(["export", "--checkpoint", str(trained_run()), "--out", str(export)]) == 0
    return {**inputs, "export": export, "regression": trainer_data.shard_dir(172, 4)}


def store_ids(shards: Path | str) -> list[str]:
    with cf.open_shard_directory(str(shards)) as directory:
        return [entry.record_id for entry in directory.iter_index()]


@functools.cache
def new_conversations(start: int, count: int) -> tuple[cf.CaptureRecord, ...]:
    return tuple(trainer_data.capture_records(start, count))


def add_records(shards: Path, start: int, count: int, metadata=None) -> list[str]:
    """Writes conversations start..start+count-1 into shards as new sealed shards (numbered after the ones there);
    metadata(index) -> a record's metadata, when given. Returns their ids."""
    records = list(new_conversations(start, count))
    if metadata is not None:
        records = [dataclasses.replace(record, metadata=metadata(index)) for index, record in enumerate(records)]
    before = set(store_ids(shards))
    cf.write_shards(records, shards, records_per_shard=3)
    ids = [record.record_id for record in records]
    assert before.isdisjoint(ids) and store_ids(shards)[-count:] == ids
    return ids


class Setup:
    """A registry initialised with the first version, its shard folder and a way to open loops on it."""

    def __init__(self, base, tmp_path: Path, **changes) -> None:
        self.shards = tmp_path / "shards"
        shutil.copytree(base["train_shards"], self.shards)
        self.initial_ids = store_ids(self.shards)
        assert len(self.initial_ids) == 64
        self.config = LoopConfig(
            registry=str(changes.pop("registry", tmp_path / "registry")), shards=str(self.shards), replicas=[],
            target=str(base["target"]), draft_config=str(base["draft_config"]), vocab=str(base["vocab"]),
            work_dir=str(tmp_path / "work"), regression_shards=str(base["regression"]), min_new_records=8,
            heldout_fraction=0.25, min_heldout_records=2, replay_ratio=1.0, train_steps=TRAIN_STEPS, batch_size=4,
            max_length=256, warmup_steps=2, ttt_steps=2, probe_records=2, probe_max_new_tokens=16, poll_s=0.0,
            min_coverage=0.5)  # a 512-token draft vocabulary covers about 70% of these records' loss tokens
        self.config = dataclasses.replace(self.config, **changes)
        self.lines: list[str] = []
        with self.loop() as loop:
            assert loop.init(base["export"], trained_on=self.initial_ids) == "v0001"

    def loop(self, **changes) -> Loop:
        return Loop(dataclasses.replace(self.config, **changes), log_line=self.lines.append)


def kinds(registry: Registry, since: int = 0) -> list[str]:
    return [event["kind"] for event in registry.events(since=since)]


def last_event(registry: Registry) -> int:
    return max((event["event"] for event in registry.events()), default=0)


# --------------------------------------------------------------------------------------------------- rounds
def test_a_round_starts_at_min_new_records_and_the_gate_decides_both_ways(base, tmp_path):
    setup = Setup(base, tmp_path)
    with setup.loop(gate_margin=10.0) as loop:  # no candidate can gain 10 tokens per step: rejected
        registry = loop.registry
        assert registry.read_round("r0000")["new_record_ids"] == setup.initial_ids
        probe = registry.version("v0001").info["probe"]
        assert probe["record_ids"] == store_ids(base["regression"])[:2] and probe["served_walk"] >= 1.0

        first_new = add_records(setup.shards, 64, 5)
        report = loop.tick()
        assert report["round"] is None and report["replicas"] == {}  # 5 < min_new_records
        assert registry.round_names() == ["r0000"]
        new = first_new + add_records(setup.shards, 69, 3)
        report = loop.tick()
        result = report["round"]
        assert result["round"] == "r0001" and result.get("version") == "v0002", result
        assert result["decision"] == "reject"
        assert "promotion" not in report

        info = registry.read_round("r0001")
        heldout = new[-2:]  # max(min_heldout_records 2, round(8 x 0.25)): the newest, last in store order
        assert info["heldout_record_ids"] == heldout and info["new_record_ids"] == new[:-2]
        assert store_ids(setup.shards)[-2:] == heldout
        assert len(info["replay_record_ids"]) == 6 and set(info["replay_record_ids"]) <= set(setup.initial_ids)
        assert len(set(info["replay_record_ids"])) == 6
        assert "8 new records" in info["why"] and info["serving"] == "v0001"
        run_dir = Path(info["training"]["run_dir"])
        trained = json.loads((run_dir / "training_records.json").read_text())["record_ids"]
        assert trained == info["new_record_ids"] + info["replay_record_ids"]
        assert set(trained).isdisjoint(heldout)

        version = registry.version("v0002")
        assert version.parent == "v0001"
        made = version.info["made"]
        assert made["round"] == "r0001" and made["init_from"] == "v0001" and made["steps"] == TRAIN_STEPS
        assert (made["new_records"], made["replay_records"], made["heldout_records"]) == (6, 6, 2)
        assert made["training_records_sha256"] == rounds.ids_digest(trained)
        assert made["heldout_records_sha256"] == rounds.ids_digest(heldout)
        evaluation = version.info["eval"]
        for part in ("heldout", "regression"):
            for label in ("candidate", "serving"):
                figures = evaluation[part][label]
                assert figures["served_walk"] >= 1.0, (part, label, figures)
            expected_records = 2 if part == "heldout" else 4
            assert evaluation[part]["candidate"]["num_records"] == expected_records
        assert evaluation["gate"] == {"passed": False, "why": result["why"], "margin": 10.0,
                                      "regression_tolerance": 0.05}
        assert "the gate asks for +10.000" in result["why"]
        assert version.info["probe"]["served_walk"] >= 1.0  # the candidate's simulated probe is stored too
        state = registry.state()
        assert state["versions"]["v0002"]["state"] == "rejected" and state["promoted"] == "v0001"
        assert registry.local_copy("v0002").is_dir()
        gate_events = [e for e in registry.events() if e["kind"] == "gate"]
        assert [(e["round"], e["version"], e["passed"]) for e in gate_events] == [("r0001", "v0002", False)]

        # The finished round's records are not new to the next tick.
        assert rounds.new_records(loop) == []
        assert loop.tick()["round"] is None

    with setup.loop(gate_margin=-10.0, regression_tolerance=10.0) as loop:  # every candidate passes
        registry = loop.registry
        more = add_records(setup.shards, 72, 8)
        before = last_event(registry)
        report = loop.tick()
        result = report["round"]
        assert result["round"] == "r0002" and result["version"] == "v0003" and result["decision"] == "promote"
        info = registry.read_round("r0002")
        assert info["heldout_record_ids"] == more[-2:] and info["new_record_ids"] == more[:-2]
        # replay is drawn from every earlier round's new records (r0000 and r0001), never from held-out ones
        assert set(info["replay_record_ids"]) <= set(setup.initial_ids) | set(new[:-2])
        assert registry.version("v0003").parent == "v0001"  # the promoted version, not the rejected v0002
        assert registry.version("v0003").info["eval"]["gate"]["passed"] is True
        # replicas=[]: no canary can be swapped, so the promotion stays pending for a later tick or start
        promotion = report["promotion"]
        assert promotion == {"version": "v0003", "state": "promoting", "why": "no replica answered", "replicas": {}}
        state = registry.state()
        assert state["versions"]["v0003"]["state"] == "promoting" and state["promoted"] == "v0001"
        assert state["pending"]["to"] == "v0003" and state["pending"]["from"] == "v0001"
        decided = [kind for kind in kinds(registry, before) if kind in ("gate", "promoting", "promoted", "rejected")]
        assert decided == ["gate", "promoting"]
    # a restarted loop takes the pending promotion up again, and with no replica it stays pending
    with setup.loop() as loop:
        state = loop.registry.state()
        assert state["pending"]["to"] == "v0003" and state["versions"]["v0003"]["state"] == "promoting"
    assert any("taking up the promotion of v0003" in line for line in setup.lines)


def test_the_age_trigger_starts_a_round_with_fewer_than_min_new_records(base, tmp_path):
    setup = Setup(base, tmp_path, min_new_records=100, max_age_s=60.0, gate_margin=10.0)
    with setup.loop() as loop:
        early = add_records(setup.shards, 64, 2)
        assert loop.tick()["round"] is None
        seen = {record_id: loop.first_seen[record_id] for record_id in early}
        assert set(loop.first_seen) == set(early)  # r0000's records are not new, so never aged
        for record_id in early:  # as if this loop had seen them 61 s ago
            loop.first_seen[record_id] -= 61.0
        # aged, but only min_heldout_records of them: nothing would be left to train on
        assert rounds.due(loop, rounds.new_records(loop)) is None
        assert loop.tick()["round"] is None
        late = add_records(setup.shards, 66, 2)
        report = loop.tick()
        assert {record_id: loop.first_seen[record_id] for record_id in early} == \
            {record_id: when - 61.0 for record_id, when in seen.items()}  # first seen is never moved forward
        result = report["round"]
        assert result is not None and result["decision"] == "reject", result
        info = loop.registry.read_round(result["round"])
        assert "4 new records, the oldest waiting 6" in info["why"]
        assert info["heldout_record_ids"] == late and info["new_record_ids"] == early
        assert loop.registry.state()["versions"][result["version"]]["state"] == "rejected"


def test_a_round_trained_by_two_torchrun_processes_gives_the_one_process_version(base, tmp_path):
    import torch
    from safetensors.torch import load_file

    with pytest.raises(ValueError, match="train_processes=3 must be at least 1 and divide batch_size=4"):
        LoopConfig(registry="r", shards="s", target="t", draft_config="d", vocab="v", work_dir="w", batch_size=4,
                   train_processes=3)  # refused when the settings are read, before any round
    weights, trained, infos = {}, {}, {}
    for processes in (1, 2):  # the same round, the same global batch of 4: in the loop's process, then 2 x 2
        setup = Setup(base, tmp_path / f"p{processes}", gate_margin=-10.0, regression_tolerance=10.0,
                      train_processes=processes, train_num_threads=1)
        with setup.loop() as loop:
            add_records(setup.shards, 64, 8)
            result = loop.tick()["round"]
            assert result["version"] == "v0002" and result["decision"] == "promote", result
            infos[processes] = loop.registry.read_round("r0001")
            weights[processes] = load_file(loop.registry.local_copy("v0002") / "model.safetensors")
            trained[processes] = load_file(Path(infos[processes]["training"]["run_dir"]) / "final" / "model.safetensors")
    assert infos[1]["training"]["launcher"] is None and infos[1]["training"]["processes"] == 1
    assert "torch.distributed.run" in infos[2]["training"]["launcher"] and infos[2]["training"]["processes"] == 2
    train_dir = Path(infos[2]["training"]["run_dir"])
    assert json.loads((train_dir.parent / "train-config.json").read_text())["data"]["batch_size"] == 2
    assert '"finished": true' in (train_dir.parent / "train.log").read_text()  # the launcher's output is kept
    assert infos[1]["new_record_ids"] == infos[2]["new_record_ids"]
    assert infos[1]["replay_record_ids"] == infos[2]["replay_record_ids"]
    assert infos[1]["training"]["steps"] == infos[2]["training"]["steps"] == TRAIN_STEPS
    assert infos[2]["training"]["last_loss"] == pytest.approx(infos[1]["training"]["last_loss"], rel=1e-4)
    assert trained[1].keys() == trained[2].keys()
    for name, tensor in trained[1].items():  # the fp32 weights the round trained
        torch.testing.assert_close(trained[2][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    assert weights[1].keys() == weights[2].keys()
    for processes in (1, 2):  # each version is its round's fp32 weights, rounded to bf16 once
        shared = [name for name in weights[processes] if name in trained[processes]]
        assert "fc.weight" in shared and "midlayer.mlp.gate_proj.weight" in shared, shared
        for name in shared:
            exported = weights[processes][name]
            assert torch.equal(exported, trained[processes][name].to(exported.dtype)), name
    for name, tensor in weights[1].items():  # so the two versions sit one rounding step apart, or within the fp32 atol
        torch.testing.assert_close(weights[2][name].float(), tensor.float(), rtol=2 ** -7, atol=1e-5, msg=name)
    assert not torch.equal(weights[2]["fc.weight"], load_file(base["export"] / "model.safetensors")["fc.weight"])


def test_coverage_below_the_floor_trains_nothing_and_asks_for_a_new_mapping(base, tmp_path):
    setup = Setup(base, tmp_path, min_coverage=1.01)
    with setup.loop() as loop:
        new = add_records(setup.shards, 64, 8)
        before = last_event(loop.registry)
        result = loop.tick()["round"]
        assert result["decision"] == "coverage_low" and "new mapping" in result["why"]
        assert "version" not in result
        registry = loop.registry
        assert registry.version_names() == ["v0001"]
        events = list(registry.events(since=before))
        low = [e for e in events if e["kind"] == "coverage_low"]
        assert len(low) == 1 and "new mapping" in low[0]["why"] and low[0]["round"] == "r0001"
        assert 0.0 < low[0]["coverage"] <= 1.0 and low[0]["loss_tokens"] > 0
        assert "registered" not in [e["kind"] for e in events] and "gate" not in [e["kind"] for e in events]
        info = registry.read_round("r0001")
        assert info["decision"] == "coverage_low" and "training" not in info
        assert info["new_record_ids"] + info["heldout_record_ids"] == new
        assert not (Path(setup.config.work_dir) / "r0001" / "train").exists()
        assert rounds.new_records(loop) == []  # marked used: the next tick does not ask again
        assert loop.tick()["round"] is None


def test_a_candidate_left_without_a_decision_is_abandoned_and_its_records_are_new_again(base, tmp_path):
    setup = Setup(base, tmp_path, min_new_records=100)
    new = add_records(setup.shards, 64, 8)
    loop = setup.loop()
    loop.__enter__()
    # What a loop killed right after storing its candidate leaves: the version, no decision, no round file.
    loop.registry.add_version(base["export"], parent="v0001", made={"round": "r0001"})
    assert loop.registry.state()["versions"]["v0002"]["state"] == "candidate"
    loop.__exit__(None, None, None)
    with setup.loop() as again:
        state = again.registry.state()
        assert state["versions"]["v0002"]["state"] == "abandoned" and state["promoted"] == "v0001"
        assert kinds(again.registry)[-1] == "abandoned"
        assert [entry.record_id for entry in rounds.new_records(again)] == new


def test_a_candidate_whose_round_was_written_but_not_promoted_gives_its_records_back(base, tmp_path):
    """Killed between a passed gate's round file and the promotion: the version is still a candidate; a restart
    abandons it, and the module docstring of run.py says its round's records are new again."""
    setup = Setup(base, tmp_path, min_new_records=100)
    new = add_records(setup.shards, 64, 8)
    with setup.loop() as loop:
        loop.registry.add_version(base["export"], parent="v0001", made={"round": "r0001"})
        loop.registry.write_round("r0001", {"round": "r0001", "version": "v0002", "decision": "promote",
                                            "new_record_ids": new[:6], "heldout_record_ids": new[6:],
                                            "replay_record_ids": setup.initial_ids[:6]})
    with setup.loop(min_new_records=8, gate_margin=10.0) as again:
        assert again.registry.state()["versions"]["v0002"]["state"] == "abandoned"
        assert [entry.record_id for entry in rounds.new_records(again)] == new
        result = again.tick()["round"]  # the next round takes them up: none of them replayed as an older record
        assert (result["round"], result["version"], result["decision"]) == ("r0002", "v0003", "reject")
        info = again.registry.read_round("r0002")
        assert info["new_record_ids"] == new[:6] and info["heldout_record_ids"] == new[6:]
        assert set(info["replay_record_ids"]) <= set(setup.initial_ids)
        assert rounds.new_records(again) == []


# -------------------------------------------------------------------------------------------- object store
def fake_draft(folder: Path, content: bytes = b"weights") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (folder / "model.safetensors").write_bytes(content * 100)
    return folder


def test_a_registry_on_an_object_store(s3, tmp_path):  # noqa: F811
    from capture_format.object_store import parse_location, s3_filesystem

    url = f"s3://{new_bucket(s3, 'loop-registry')}/drafts"
    fs = s3_filesystem()
    location = parse_location(url)
    registry = Registry(url, cache_dir=tmp_path / "cache")
    with pytest.raises(RegistryError, match="reading only"):
        registry.add_version(fake_draft(tmp_path / "a"), parent=None, made={})
    registry.lock(lease_s=60.0)
    try:
        version = registry.add_version(fake_draft(tmp_path / "a"), parent=None, made={"how": "test"})
        assert version.name == "v0001" and registry.version_names() == ["v0001"]
        registry.set_version_state("v0001", "promoted", "first")
        second = registry.add_version(fake_draft(tmp_path / "b", b"other"), parent="v0001", made={})
        assert second.name == "v0002" and second.parent == "v0001"
        registry.write_round("r0001", {"round": "r0001", "new_record_ids": ["a"], "heldout_record_ids": ["b"]})
        assert registry.used_record_ids() == {"a", "b"}
        copy = registry.local_copy("v0001")
        assert copy == tmp_path / "cache" / "v0001"
        assert (copy / "model.safetensors").read_bytes() == b"weights" * 100
        state = Registry(url, create=False).state()  # a reader (loop status) sees the same document
        assert state["promoted"] == "v0001" and state["versions"]["v0002"]["state"] == "candidate"
        assert kinds(registry) == ["registered", "promoted", "registered"]
        assert [e["event"] for e in registry.events()] == [1, 2, 3]

        # An object damaged in the bucket (same size): a fresh cache refuses it, and keeps nothing of it.
        fs.pipe_file(location.path("v0002/model.safetensors"), b"OTHER" * 100)
        fresh = Registry(url, cache_dir=tmp_path / "fresh-cache")
        with pytest.raises(RegistryError, match=r"v0002/model\.safetensors in s3://.* is damaged"):
            fresh.local_copy("v0002")
        assert not (tmp_path / "fresh-cache" / "v0002" / "model.safetensors").exists()
        # A cached copy damaged on disk is refused and fetched again next time.
        cached = copy / "model.safetensors"
        cached.write_bytes(b"W" + cached.read_bytes()[1:])
        with pytest.raises(RegistryError, match="damaged"):
            registry.local_copy("v0001")
        assert (registry.local_copy("v0001") / "model.safetensors").read_bytes() == b"weights" * 100
        # A partial version (no version.json) is never listed, and the next lock removes it.
        fs.pipe_file(location.path("v0003/config.json"), b"{}")
        assert registry.version_names() == ["v0001", "v0002"]

        # The lease: another owner's fresh lease refuses a second loop ...
        other = {"host": "elsewhere", "pid": 1, "at": time.time(), "lease_s": 60.0, "token": "0" * 16}
        registry.store.write(LOCK_FILE, json.dumps(other).encode())
        contender = Registry(url, cache_dir=tmp_path / "contender")
        with pytest.raises(RegistryLocked, match="another loop runs on .*elsewhere"):
            contender.lock(lease_s=60.0)
        with pytest.raises(RegistryLocked, match="taken over"):
            registry.renew()  # ... and the loop that lost it learns so on its next renewal
        # ... while a lease older than its lease time is taken over.
        registry.store.write(LOCK_FILE, json.dumps({**other, "at": time.time() - 61.0}).encode())
        contender.lock(lease_s=60.0)
        held = json.loads(fs.cat_file(location.path(LOCK_FILE)))
        assert (held["host"], held["token"]) == (socket.gethostname(), contender._lock_file["token"])
        assert "v0003" not in [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(location.path(), refresh=True)]
        assert kinds(contender)[-1] == "removed_partial_version"
        contender.renew()
        contender.unlock()
        assert not fs.exists(location.path(LOCK_FILE))
    finally:
        registry._lock_file = None  # it lost the lease above; nothing of it to release


# ---------------------------------------------------------------------------------------------------- watch
def test_served_acceptance_is_pooled_into_one_window_per_tick_and_never_counted_twice(base, tmp_path):
    from sglang_patch import speculative

    setup = Setup(base, tmp_path, min_new_records=1_000, regression_shards=None)
    spec = speculative.SpecServing(algorithm="EAGLE3", draft_path="/drafts/v0001", num_steps=3, topk=1,
                                   num_draft_tokens=4)
    # steps 3,1,0,2 | 2,1 | none | 0,0,3 ; one record without a draft:
    # 9 verify steps, 12 accepted drafts: (12 + 9) / 9 tokens per step.
    accepted = [[3, 1, 0, 2], [2, 1], [], [0, 0, 3]]

    def metadata(index: int) -> dict:
        if index == len(accepted):
            return {"source": "test"}
        return {"source": "test", "served_draft": speculative.served_draft_metadata(
            draft="ab" * 16, spec=spec, accepted=accepted[index])}

    with setup.loop() as loop:
        report = loop.tick()
        window = report["window"]  # the first tick sees r0000's records, captured without a draft
        assert window["records"] == 64 and window["records_without_draft"] == 64 and window["verify_steps"] == 0
        assert window["acceptance_length"] is None
        assert loop.tick()["window"] is None  # nothing arrived
        served = add_records(setup.shards, 64, 5, metadata=metadata)
        window = loop.tick()["window"]
        assert window["records"] == 5 and window["records_without_draft"] == 1
        assert window["records_invalid_served_draft"] == 0
        assert (window["verify_steps"], window["accepted_drafts"]) == (9, 12)
        assert window["acceptance_length"] == pytest.approx(21 / 9)
        assert window["promoted"] == "v0001"
        [tally] = window["drafts"]
        assert tally["draft"] == "ab" * 16 and tally["num_records"] == 4 and tally["num_steps"] == 3
        assert tally["accepted_at_position"] == [6, 4, 2]  # steps accepting >0, >1, >2 drafts
        events = [e for e in loop.registry.events() if e["kind"] == "window"]
        assert len(events) == 2 and events[-1]["record_ids"] == served
    with setup.loop() as again:  # a restarted loop counts none of them again
        assert again.tick()["window"] is None
        one_more = add_records(setup.shards, 69, 1, metadata=lambda index: metadata(0))
        window = again.tick()["window"]
        assert window["records"] == 1 and (window["verify_steps"], window["accepted_drafts"]) == (4, 6)
        assert [e for e in again.registry.events() if e["kind"] == "window"][-1]["record_ids"] == one_more
