"""Swapping a served draft's weights in place: how long it takes, how long generation stalls, what SGLang checks.

Per width in `hidden_sizes`, one CPU SGLang server at a time (stopped before the next starts) serves a target
of that hidden size with EAGLE-3 chain drafting, and `eagle_tap.serve.swap.swap_draft` puts two random drafts
of the same shape (A, the one it started with, and B, other weights) into it by turns, A -> B -> A ...:
`num_swaps` swaps idle that also take the target's checksum (`check_target`, as every swap did before the loop
took it only on meeting a replica), `num_swaps` idle that take the draft's only (what the loop's promotions do),
then `num_swaps` more, draft only, while `load_concurrency` threads send greedy requests throughout, `gap_s`
apart. Width 128 is the bundled tiny target; other widths are random Llama targets built here (`num_layers` layers,
heads of 64, intermediate 4x hidden, the tiny tokenizer's 4,096-token vocab), since the draft's width is the
target's (it shares the target's embed_tokens). Both drafts are the trainer's initialisation (`Eagle3Draft`,
seeds 0 and 1), exported as `eagle-tap export` writes a draft, in bf16 like the targets.

Reported per width and condition:
- draft bytes sent: the tensors a swap sends (every exported one but the vocab mapping and embed_tokens);
- swap wall time: the whole `swap_draft` call (checks, loading and serialising the tensors, SGLang's checksums
  before and after, the five weight-update calls), and apart, idle, its checks + load + serialise and the
  checksum calls (draft and target, before and after: each target one hashes the whole target on the
  scheduler's thread, so requests stall for it outside the pause too);
- scheduler pause: `SwapResult.paused_s`, pause to continue, the stall running requests see; per GB sent;
- verified: every swap moved the draft's checksum to that of the set sent (B's differs from A's, and A's after
  a swap back is the one the server started with); the target's is unchanged by every swap that checked it,
  and after the last swap equal to the one at start-up;
- under load: requests answered and failed (an exception, or fewer tokens than asked), how many were in
  flight across a whole swap call (started before it, finished after: paused in place, not dropped), and a
  request's median time (a random draft proposes nothing right, so about one target step per token).
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle_tap.serve.draft import SpeculativeConfig
from eagle_tap.serve.swap import _serialize  # swap_draft's own serialiser, timed apart
from eagle_tap.serve.swap import SwapResult, draft_tensors, swap_draft
from eagle_tap.serve.http_api import weights_checksum
from trainer.draft_fit import check_draft_fits, in_place_of
from eagle_tap.serve.sglang_server import ServerConfig, SGLangServer
from eagle_tap.serve.http_api import post_json
from eagle_tap.testbed.tiny_model import TINY_MODEL_DIR

TINY_HIDDEN_SIZE = 128
"""The bundled tiny target's width: served as it is; other widths get a random target."""
HEAD_DIM = 64
CONDITIONS = ("idle+target", "idle", "load")
"""Idle swaps that also check the target, idle swaps that check the draft only, and draft-only swaps under load."""


@dataclass(kw_only=True, slots=True)
class Config:
    """The widths, the swaps and the load."""

    hidden_sizes: tuple[int, ...] = (128, 1024, 2048)
    """Target (and draft) widths, one server each; 128 serves the bundled tiny target."""
    num_swaps: int = 5
    """Swaps per condition (idle, then under load), alternating the two drafts."""
    num_layers: int = 4
    """Decoder layers of a random target; its capture layers are 1, L/2, L-1."""
    num_steps: int = 3
    """Drafts per verify step (a chain)."""
    gap_s: float = 1.0
    """Wait between swaps: under load, generation runs between them and requests cross a swap or two."""
    load_concurrency: int = 2
    """Threads sending greedy requests, one after another each, for the whole loaded phase."""
    prompt_tokens: int = 24
    max_new_tokens: int = 32
    """Tokens each load request generates (the end-of-sequence token ignored)."""
    max_total_tokens: int = 16_384
    """SGLang's KV pool in tokens (the widest target's pool stays small next to the machine's memory)."""

    def __post_init__(self) -> None:
        if self.num_swaps < 1 or self.load_concurrency < 1:
            raise ValueError(f"num_swaps and load_concurrency must be at least 1; got {self.num_swaps} and "
                             f"{self.load_concurrency}")
        for hidden_size in self.hidden_sizes:
            if hidden_size != TINY_HIDDEN_SIZE and (hidden_size <= 0 or hidden_size % (4 * HEAD_DIM)):
                raise ValueError(f"hidden size {hidden_size} is neither {TINY_HIDDEN_SIZE} (the tiny target) nor a "
                                 f"positive multiple of {4 * HEAD_DIM} (heads of {HEAD_DIM}, 4 query heads per KV head)")

    @classmethod
    def quick(cls) -> Config:
        return cls(hidden_sizes=(128, 1024), num_swaps=2)


def build_target(hidden_size: int, num_layers: int, out_dir: Path) -> Path:
    """A random bf16 Llama target of this width in out_dir: the random llama of `eagle_tap.testbed.tiny_model.random`
    with heads of 64, intermediate 4x hidden, the tiny tokenizer."""
    from eagle_tap.testbed.tiny_model.random import build_wide_llama

    return build_wide_llama(out_dir, hidden_size=hidden_size, num_layers=num_layers,
                            intermediate_size=4 * hidden_size, head_dim=HEAD_DIM, num_heads=hidden_size // HEAD_DIM,
                            num_kv_heads=hidden_size // (4 * HEAD_DIM))


def capture_layers(num_layers: int) -> list[int]:
    """The project's default capture layers where they are distinct (8 layers and more), else 1, L/2, L-1."""
    import capture_format as cf

    return cf.default_capture_layers(num_layers) if num_layers >= 8 else [1, num_layers // 2, num_layers - 1]


def random_draft(target_dir: Path, out_dir: Path, *, seed: int) -> Path:
    """The trainer's initialisation of a draft for target_dir (draft vocab = the target's), exported as
    `eagle-tap export` writes one: config.json and model.safetensors in SGLang's names, bf16."""
    import torch
    from safetensors.torch import save_file

    from trainer.draft_config import build_draft_config
    from trainer.export import checked_tensors, export_config
    from trainer.model import Config as DraftShape
    from trainer.model import Eagle3Draft, trainable_state_dict
    from trainer.vocab import read_model_config

    num_layers = read_model_config(target_dir)["num_hidden_layers"]
    config = export_config(build_draft_config(target_dir, capture_layers=capture_layers(num_layers)))
    torch.manual_seed(seed)
    draft = Eagle3Draft(DraftShape.from_draft_config(config))
    if config["draft_vocab_size"] != config["vocab_size"]:
        raise ValueError(f"a random draft keeps the target's whole vocab; the derived config has "
                         f"{config['draft_vocab_size']} of {config['vocab_size']} tokens")
    draft.t2d.fill_(True)  # every target token is a draft token; d2t's offsets stay 0
    out_dir.mkdir(parents=True)
    save_file(checked_tensors(trainable_state_dict(draft), config), out_dir / "model.safetensors",
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out_dir


class Load:
    """Threads sending greedy requests back to back until stopped; each request's (start, end, ok)."""

    def __init__(self, url: str, config: Config) -> None:
        self._url, self._config = url, config
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._send, args=(number,), daemon=True)
                         for number in range(config.load_concurrency)]
        self.requests: list[tuple[float, float, bool]] = []

    def _send(self, number: int) -> None:
        import random

        rng = random.Random(number)
        while not self._stop.is_set():
            ids = [rng.randrange(3, 4096) for _ in range(self._config.prompt_tokens)]
            started = time.perf_counter()
            try:
                sampling = {"max_new_tokens": self._config.max_new_tokens, "temperature": 0, "ignore_eos": True}
                answer = post_json(f"{self._url}/generate", {"input_ids": ids, "sampling_params": sampling},
                                   timeout_s=600)
                ok = len(answer.get("output_ids") or ()) == self._config.max_new_tokens
            except Exception:  # a failed request is what this counts, whatever the failure
                ok = False
            self.requests.append((started, time.perf_counter(), ok))

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        while not self.requests and all(thread.is_alive() for thread in self._threads):
            time.sleep(0.05)  # swap under load only once requests flow (the first one has returned)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def parts_s(url: str, drafts: dict[str, Path], repeats: int = 3) -> dict[str, float]:
    """Median times of parts of a swap, done here as swap_draft does them but without the update: the checks,
    loading and serialising of B's tensors (`prepare`), its two draft checksum calls (`draft_checksums`, before
    and after) and the four calls of a swap that also checks the target (`checksums`)."""
    times: dict[str, list[float]] = {"prepare": [], "draft_checksums": [], "checksums": []}
    for _ in range(repeats):
        started = time.perf_counter()
        check_draft_fits(drafts["B"], **in_place_of(drafts["A"]))
        named = draft_tensors(drafts["B"])
        _serialize(named)
        times["prepare"].append(time.perf_counter() - started)
        for part, selectors in (("draft_checksums", ("draft", "draft")),
                                ("checksums", ("draft", "target", "draft", "target"))):
            started = time.perf_counter()
            for selector in selectors:
                weights_checksum(url, selector)
            times[part].append(time.perf_counter() - started)
    return {part: statistics.median(values) for part, values in times.items()}


def swap_turns(url: str, drafts: dict[str, Path], num_swaps: int, serving: str, gap_s: float, *,
               check_target: bool = False) -> list[dict[str, Any]]:
    """num_swaps swaps alternating drafts "A" and "B", starting from `serving`, gap_s apart: per swap the set
    sent, the call's start and end (perf_counter) and SGLang's result."""
    swaps = []
    for _ in range(num_swaps):
        time.sleep(gap_s)
        sent = "B" if serving == "A" else "A"
        started = time.perf_counter()
        result = swap_draft(url, drafts[sent], serving_dir=drafts["A"], check_target=check_target)
        swaps.append({"sent": sent, "started": started, "ended": time.perf_counter(), "result": result})
        serving = sent
    return swaps


def verified(swaps: list[dict[str, Any]], checksum_of: dict[str, str], target_checksum: str) -> bool:
    """Every swap moved the draft's checksum from the set serving to the set sent, and one that checked the target
    left it as it was at start-up; checksum_of ("A": the server's start-up draft) learns B's from its first swap."""
    held = True
    for swap in swaps:
        result: SwapResult = swap["result"]
        before = checksum_of.get("A" if swap["sent"] == "B" else "B")
        after = checksum_of.setdefault(swap["sent"], result.draft_checksum_after)
        held &= result.draft_checksum_before == before and result.draft_checksum_after == after
        if result.target_checked:
            held &= result.target_checksum_before == target_checksum == result.target_checksum_after
    return held and "B" in checksum_of and checksum_of["B"] != checksum_of["A"]


def measure_width(config: Config, hidden_size: int, work: Path) -> dict[str, Any]:
    """Serves one width, swaps idle and under load; the numbers of the module docstring for this width."""
    if hidden_size == TINY_HIDDEN_SIZE:
        target, target_note = TINY_MODEL_DIR, "tiny-llama (bundled, 8 layers)"
    else:
        target = build_target(hidden_size, config.num_layers, work / f"target-{hidden_size}")
        target_note = f"random llama, {config.num_layers} layers"
    drafts = {name: random_draft(target, work / f"draft-{hidden_size}-{name}", seed=seed)
              for seed, name in enumerate("AB")}
    draft_bytes = sum(tensor.numel() * tensor.element_size() for _, tensor in draft_tensors(drafts["A"]))
    server = SGLangServer(ServerConfig(
        model_path=target, speculative=SpeculativeConfig(draft_dir=drafts["A"], num_steps=config.num_steps),
        extra_args=("--max-total-tokens", str(config.max_total_tokens)), log_path=work / f"server-{hidden_size}.log"))
    with server:
        checksum_of = {"A": weights_checksum(server.url, "draft")}
        target_checksum = weights_checksum(server.url, "target")
        parts = parts_s(server.url, drafts)
        checked = swap_turns(server.url, drafts, config.num_swaps, serving="A", gap_s=config.gap_s,
                             check_target=True)
        idle = swap_turns(server.url, drafts, config.num_swaps, serving=checked[-1]["sent"], gap_s=config.gap_s)
        with Load(server.url, config) as load:
            loaded = swap_turns(server.url, drafts, config.num_swaps, serving=idle[-1]["sent"], gap_s=config.gap_s)
        target_at_end = weights_checksum(server.url, "target")
    measured: dict[str, Any] = {"hidden_size": hidden_size, "target": target_note, "draft_bytes": draft_bytes,
                                "num_tensors": idle[0]["result"].num_tensors, "prepare_ms": parts["prepare"] * 1e3,
                                "checksums_ms": parts["checksums"] * 1e3,
                                "draft_checksums_ms": parts["draft_checksums"] * 1e3}
    for condition, swaps in (("idle+target", checked), ("idle", idle), ("load", loaded)):
        measured[condition] = {"wall_ms": [(swap["ended"] - swap["started"]) * 1e3 for swap in swaps],
                               "paused_ms": [swap["result"].paused_s * 1e3 for swap in swaps],
                               "verified": verified(swaps, checksum_of, target_checksum)
                               and target_at_end == target_checksum}
    measured["load"].update(
        requests_ok=sum(ok for _, _, ok in load.requests), requests_failed=sum(not ok for _, _, ok in load.requests),
        requests_across_a_swap=sum(any(start < swap["started"] and end > swap["ended"] for swap in loaded)
                                   for start, end, _ in load.requests),
        request_s=statistics.median(end - start for start, end, _ in load.requests))
    return measured


def _swaps(count: int) -> str:
    return f"{count} swap{'' if count == 1 else 's'}"


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"


COLUMNS = [
    ["hidden_size", "hidden", "s"],
    ["condition", "condition", "s"],
    ["draft_gb", "draft GB sent", ".4f"],
    ["wall_range", "swap wall ms, median (range)", "s"],
    ["paused_range", "scheduler pause ms, median (range)", "s"],
    ["paused_ms_per_gb", "pause ms per GB", ",.0f"],
    ["wall_ms_per_gb", "wall ms per GB", ",.0f"],
    ["verified", "checksums verified", "s"],
    ["requests", "requests ok / failed (in flight across a swap)", "s"],
]
"""The table; each row also holds the medians `wall_ms` and `paused_ms` as numbers."""


def report(config: Config, measured: list[dict[str, Any]]) -> dict[str, Any]:
    """The bench report's entry: a row per width and condition, the notes, `measured` in the summary."""
    rows = []
    for width in measured:
        gigabytes = width["draft_bytes"] / 1e9
        for condition in CONDITIONS:
            entry = width[condition]
            wall, paused = statistics.median(entry["wall_ms"]), statistics.median(entry["paused_ms"])
            requests = "-"
            if condition == "load":
                requests = f"{entry['requests_ok']} / {entry['requests_failed']} ({entry['requests_across_a_swap']})"
            rows.append({"hidden_size": width["hidden_size"], "condition": condition, "draft_gb": gigabytes,
                         "wall_ms": wall, "wall_range": _spread(entry["wall_ms"]), "paused_ms": paused,
                         "paused_range": _spread(entry["paused_ms"]), "paused_ms_per_gb": paused / gigabytes,
                         "wall_ms_per_gb": wall / gigabytes,
                         "verified": f"{'yes' if entry['verified'] else 'NO'} ({_swaps(len(entry['wall_ms']))})",
                         "requests": requests})
    failed = sum(width["load"]["requests_failed"] for width in measured)
    all_verified = all(width[condition]["verified"] for width in measured for condition in CONDITIONS)
    notes = [
        "targets: " + "; ".join(f"{width['hidden_size']}: {width['target']}, draft {width['num_tensors']} tensors "
                                 f"{width['draft_bytes'] / 1e6:,.1f} MB" for width in measured)
        + f"; bf16, EAGLE-3 chain of {config.num_steps} (top-k 1), KV pool {config.max_total_tokens:,} tokens, one "
        "server at a time",
        f"{_swaps(config.num_swaps)} idle, then {config.num_swaps} under load, alternating two random drafts "
        f"(A -> B -> A ...), {config.gap_s:g} s apart; load: {config.load_concurrency} threads sending greedy "
        f"requests of {config.prompt_tokens} prompt tokens and {config.max_new_tokens} generated, back to back",
        "swap wall: the whole swap_draft call (checks, load + serialise, the checksum calls, pause, begin, update, "
        "end, continue); idle+target: each swap also takes the target's checksum before and after (as every swap "
        "did before the loop took it only on meeting a replica), idle and load: the draft's only; its parts done "
        "apart, idle (median of 3): "
        + "; ".join(f"{width['hidden_size']}: checks + load + serialise {width['prepare_ms']:,.0f} ms, 2 draft "
                    f"checksum calls {width['draft_checksums_ms']:,.0f} ms, 2 draft + 2 target "
                    f"{width['checksums_ms']:,.0f} ms" for width in measured),
        "pause: pause_generation to continue_generation (SwapResult.paused_s); per GB: median / draft GB sent",
        "verified: draft checksum = that of the set sent (B's != A's, A's = the one the server started with), target "
        "checksum unchanged by every swap that checked it and after the last swap; "
        + ("all held" if all_verified else "SOME DID NOT HOLD"),
        f"requests under load: answered in full / failed (an error or fewer tokens); {failed} failed in all; a "
        "request's median time (s): " + ", ".join(f"{width['hidden_size']}: {width['load']['request_s']:.2f}"
                                                  for width in measured),
    ]
    return {"title": "Draft swap in place: SGLang's weight-update API, idle and under load",
            "parameters": asdict(config), "columns": COLUMNS, "rows": rows,
            "summary": {"widths": measured, "all_verified": all_verified, "requests_failed": failed},
            "notes": notes}


def run(config: Config) -> dict[str, Any]:
    import sglang.srt.utils  # noqa: F401  (the serialiser's import, seconds on a CPU, stays out of the first swap)

    work = Path(tempfile.mkdtemp(prefix="eagle-tap-bench-swap-"))
    try:
        measured = [measure_width(config, hidden_size, work) for hidden_size in config.hidden_sizes]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report(config, measured)
