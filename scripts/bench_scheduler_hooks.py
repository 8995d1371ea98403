"""What the plugin's hooks cost the scheduler's thread on a replica serving an EAGLE-3 draft, called whole, as SGLang
calls them, without a server, with the processor's caches cold as after a forward.

`scripts/bench_verify_hook.py` drives the assembler alone, warm. Here each generation runs the hooks SGLang calls:
the forward hook after the prefill (`CaptureHook.__call__`), then per verify step `on_spec_forward` (after the
forward) and `on_batch_processed` (after the scheduler processed the step; the last one finishes the captures
and hands their records over), with the plugin's CPU copier (`DeferredHostCopier`) and the records handed to a
list, not a sender. Before each call (`--cold`, the default) the script writes 32 MiB, as a forward does: on the
server the hooks run right after one, and this machine's scheduler thread ran them 3-5x slower than warm. In the
server `scripts/bench_verify_hook.py`'s warm figures were never reached; these cold ones land near the
spec-capture benchmark's.

Prints, per width and share of the batch captured, the scheduler thread's CPU per captured token (thread CPU
time around each call, median of `--repeats` runs) and what the hooks counted themselves (`hook_cpu_ns`,
measured on some calls: `sglang_patch.stats.HookTimer`), then the median call of each kind. With `--records`, the
sender's side of the same records instead: per record (caches evicted before each unless `--warm`), the CPU of
joining its rows (`CapturedSequence.state_arrays`) and of making and encoding its frame (`to_records`,
`encode_frame`), median of each run's records, runs of fresh records. With `--floor`, a verify step's two calls
(after the forward, after its processing) as they are and with the step's capture work left out: what any design
pays that runs a Python hook at those two points, the floor under the scheduler thread's cost per captured token.
With `--draftless`, a server without a draft: decode steps of one token a request instead of verify steps.

    .venv/bin/python scripts/bench_scheduler_hooks.py [--generations 10] [--steps 10] [--repeats 3] [--warm]
        [--batch 8] [--records | --floor | --draftless]
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from capture_format import encode_frame
from capture_format.tag import CaptureTag
from sglang_patch.capture import CaptureAssembler
from sglang_patch.device_copy import DeferredHostCopier
from sglang_patch.forward_hook import CaptureHook
from sglang_patch.sender import ModelIdentity, to_records
from sglang_patch.settings import CaptureSettings
from sglang_patch.speculative import SpecServing

NUM_STEPS, NUM_DRAFT_TOKENS = 3, 4  # a chain of 3: 4 candidate rows a request
CHAIN = SpecServing(algorithm="EAGLE3", draft_path="draft", num_steps=NUM_STEPS, topk=1,
                    num_draft_tokens=NUM_DRAFT_TOKENS)
PROMPT_LEN = 16
EVICT = torch.ones(8 << 20, dtype=torch.float32)  # 32 MiB, written before each call when cold


def states(shape: tuple[int, int]) -> torch.Tensor:
    """Random bf16 rows: a forward's outputs, as costly to compress as real ones (zeros would cost nothing)."""
    return torch.randn(shape).to(torch.bfloat16)


class Mode:
    """A batch's forward mode, as the hooks read it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def is_extend(self) -> bool:
        return self.name == "EXTEND"

    def is_idle(self) -> bool:
        return False


class Req:
    """A request as SGLang's scheduler holds it under speculative decoding (the fields the plugin reads)."""

    def __init__(self, number: int, captured: bool) -> None:
        params = {}
        if captured:
            params = CaptureTag(record_id=f"rec-{number}", sample_id=f"s-{number}", loss_spans=(),
                                mode="generate").to_custom_params()
        self.rid = f"rid-{number}"
        self.origin_input_ids = list(range(PROMPT_LEN))
        self.full_untruncated_fill_ids = self.origin_input_ids
        self.output_ids: list[int] = []
        self.finished_len = self.finished_reason = self.cache_salt = self.input_embeds = None
        self.mm_inputs = self.multimodal_inputs = None
        self.spec_verify_ct = 0
        self.sampling_params = SimpleNamespace(custom_params=params)

    def finished(self) -> bool:
        return self.finished_reason is not None


def run(*, batch: int, captured: int, hidden: int, generations: int, steps: int, accepted: int,
        cold: bool, records: list | None = None, floor: bool = False, own: dict[str, int] | None = None,
        draftless: bool = False) -> tuple[float, float, dict[str, list[int]]]:
    """(thread CPU us per captured token around the calls, the hooks' own count of it, CPU ns of each call by kind).
    With `records` (a list), the records made are added to it instead of joined here. With `own` (a dict), the
    hooks' own count (`hook_cpu_ns`) of each kind of call is added to it, in ns.

    floor: the verify step's capture work left out (the assembler's `on_verify` and `on_verify_processed` do
    nothing), so its two calls cost what any design pays that runs a Python hook after each verify forward and
    after its processing: the hooks' entry, checks and timer, cold. No record comes out whole then.

    draftless: a server without a draft instead, whose decode steps add one token a request (the forward hook's
    `on_decode`), `steps` of them."""
    emitted: list = []
    hook = CaptureHook(CaptureSettings(collector_url="http://127.0.0.1:9"))
    if not draftless:
        hook._spec, hook._draft_identity = CHAIN, "d" * 32
    hook._assembler = CaptureAssembler(stats=hook.stats, emit=emitted.append, selector=hook.selector,
                                       copier=DeferredHostCopier(), served_draft=hook.served_draft)
    if floor:
        hook._assembler.on_verify = hook._assembler.on_verify_processed = lambda *args: None
    calls: dict[str, list[int]] = {}

    def call(kind: str, hook_call, *args) -> None:
        own_before = hook.stats.snapshot().get("hook_cpu_ns", 0) if own is not None else 0
        if cold:
            EVICT.mul_(1.0000001)
        started = time.thread_time_ns()
        hook_call(*args)
        calls.setdefault(kind, []).append(time.thread_time_ns() - started)
        if own is not None:
            own[kind] = own.get(kind, 0) + hook.stats.snapshot().get("hook_cpu_ns", 0) - own_before

    tokens = 0
    for generation in range(generations):
        reqs = [Req(generation * batch + i, i < captured) for i in range(batch)]
        for req in reqs:
            hook.selector.on_request(req)
        extend = SimpleNamespace(forward_mode=Mode("EXTEND"), reqs=reqs, prefix_lens=[0] * batch,
                                 extend_lens=[PROMPT_LEN] * batch)
        outputs = SimpleNamespace(hidden_states=states((batch * PROMPT_LEN, 3 * hidden)),  # (B*P, K*H)
                                  last_hidden_states=states((batch * PROMPT_LEN, hidden)))  # (B*P, H)
        call("prefill forward", hook, SimpleNamespace(logits_output=outputs), None, extend)
        for req in reqs:
            req.output_ids.append(1)
        call("prefill processed", hook.on_batch_processed, None, None, extend, SimpleNamespace())
        accept_index = torch.full((batch, NUM_STEPS + 1), -1, dtype=torch.int32)  # (B, W): a chain's front
        for i in range(batch):
            accept_index[i, : accepted + 1] = torch.arange(i * NUM_DRAFT_TOKENS, i * NUM_DRAFT_TOKENS + accepted + 1)
        decode = SimpleNamespace(forward_mode=Mode("DECODE"), reqs=reqs)
        for step in range(steps):
            if draftless:  # a decode forward: one row a request, its outputs allocated anew too
                outputs = SimpleNamespace(hidden_states=states((batch, 3 * hidden)),  # (B, K*H)
                                          last_hidden_states=states((batch, hidden)))  # (B, H)
                call("decode forward", hook, SimpleNamespace(logits_output=outputs), None, decode)
                for req in reqs:  # the scheduler processes the step
                    req.output_ids.append(2)
                    if step == steps - 1:
                        req.finished_reason = SimpleNamespace()
                call("decode processed, finishing" if step == steps - 1 else "decode processed",
                     hook.on_batch_processed, None, None, decode, SimpleNamespace())
                continue
            # Each verify forward allocates its outputs anew on CPU (the copier keeps references to them).
            outputs = SimpleNamespace(hidden_states=states((batch * NUM_DRAFT_TOKENS, 3 * hidden)),
                                      last_hidden_states=states((batch * NUM_DRAFT_TOKENS, hidden)))
            result = SimpleNamespace(logits_output=outputs, accept_index=accept_index.clone(),
                                     speculative_num_draft_tokens=NUM_DRAFT_TOKENS)
            call("verify forward", hook.on_spec_forward, result, None, decode)
            for req in reqs:  # the scheduler processes the step
                req.output_ids.extend([2] * (accepted + 1))
                req.spec_verify_ct += 1
                if step == steps - 1:
                    req.finished_reason = SimpleNamespace()
            call("verify processed, finishing" if step == steps - 1 else "verify processed", hook.on_batch_processed,
                 None, None, decode, SimpleNamespace(num_correct_drafts_per_req_cpu=[accepted] * batch))
        tokens += captured * (PROMPT_LEN + steps * (1 if draftless else accepted + 1))
    if floor:
        assert not emitted, "with the verify steps' work left out no record can be whole"
    else:
        assert len(emitted) == captured * generations, f"{len(emitted)} records, {captured * generations} captured"
    if records is not None:
        records.extend(emitted)
    else:
        for record in emitted:
            record.state_arrays()  # every row reached the record (joined here, as on the sender's thread)
    spent_ns = sum(sum(times) for times in calls.values())
    return spent_ns / 1e3 / tokens, hook.stats.snapshot().get("hook_cpu_ns", 0) / 1e3 / tokens, calls


def sender_side(records: list, hidden: int, *, cold: bool) -> tuple[float, float]:
    """Median thread CPU (us) per record of joining its rows, and of making and encoding its frames from them."""
    model = ModelIdentity(capture_layers=(1, 2, 3), hidden_size=hidden, model_fingerprint="f" * 64,
                          state_dtype="bfloat16", codec="bf16-split")
    joins, frames = [], []
    for record in records:
        if cold:
            EVICT.mul_(1.0000001)
        started = time.thread_time_ns()
        record.state_arrays()
        joined = time.thread_time_ns()
        for made in to_records(record, model):  # the rows joined above are read as they are
            encode_frame(made, model.codec)
        frames.append((time.thread_time_ns() - joined) / 1e3)
        joins.append((joined - started) / 1e3)
    return statistics.median(joins), statistics.median(frames)


def print_floor(args: argparse.Namespace) -> None:
    """A verify step's two calls as they are and with the step's capture work left out (`run(floor=True)`): thread
    CPU around each call (median) and the hooks' own count of it (`hook_cpu_ns`, mean a call), then the own count
    of a step per captured token of the step."""
    print("| hidden | captured | verify step's work | verify forward: around, own | verify processed: around, own "
          "| own a step per captured token |")
    print("|---|---|---|---|---|---|")
    for hidden in (128, 7168):
        for captured in (args.batch, 1):
            for floor in (False, True):
                per_kind: dict[str, list[int]] = {}
                own: dict[str, int] = {}
                for _ in range(args.repeats):
                    _, _, calls = run(batch=args.batch, captured=captured, hidden=hidden,
                                      generations=args.generations, steps=args.steps, accepted=args.accepted,
                                      cold=not args.warm, floor=floor, own=own)
                    for kind, times in calls.items():
                        per_kind.setdefault(kind, []).extend(times)
                cells, step_own_us = [], 0.0
                for kind in ("verify forward", "verify processed"):
                    own_us = own.get(kind, 0) / len(per_kind[kind]) / 1e3
                    step_own_us += own_us
                    cells.append(f"{statistics.median(per_kind[kind]) / 1e3:.1f}, {own_us:.1f} us")
                print(f"| {hidden} | {captured} of {args.batch} | {'none (floor)' if floor else 'as it is'} | "
                      f"{cells[0]} | {cells[1]} | {step_own_us / (captured * (args.accepted + 1)):.2f} us |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generations", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10, help="verify steps a generation")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--accepted", type=int, default=2, help="drafts each step accepts (tokens a step - 1)")
    parser.add_argument("--warm", action="store_true", help="leave the caches as the last call left them")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--records", action="store_true", help="time the sender's side of the records instead")
    mode.add_argument("--floor", action="store_true",
                      help="a verify step's two calls with its capture work and without (what any hook design pays)")
    mode.add_argument("--draftless", action="store_true",
                      help="a server without a draft: decode steps of one token a request instead of verify steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    step_tokens = 1 if args.draftless else args.accepted + 1
    tokens = PROMPT_LEN + args.steps * step_tokens
    print(f"{args.batch} requests a batch, {PROMPT_LEN} prompt tokens and {args.steps} "
          f"{'decode' if args.draftless else 'verify'} steps of {step_tokens} tokens each ({tokens} captured tokens "
          f"a request), {args.generations} generations, "
          f"caches {'warm' if args.warm else 'cold'}; {'the sender' if args.records else 'scheduler'} thread CPU, "
          f"median (range) of {args.repeats} runs")
    if args.records:
        print("| hidden | captured | join, us per record | to_records + encode_frame, us per record |")
        print("|---|---|---|---|")
        for hidden in (128, 7168):
            for captured in (args.batch, 1):
                runs = []
                for _ in range(args.repeats):
                    records: list = []
                    run(batch=args.batch, captured=captured, hidden=hidden, generations=args.generations,
                        steps=args.steps, accepted=args.accepted, cold=False, records=records)
                    runs.append(sender_side(records, hidden, cold=not args.warm))
                joins, frames = [join for join, _ in runs], [frame for _, frame in runs]
                print(f"| {hidden} | {captured} of {args.batch} | {statistics.median(joins):.1f} "
                      f"({min(joins):.1f}-{max(joins):.1f}) | {statistics.median(frames):.1f} "
                      f"({min(frames):.1f}-{max(frames):.1f}) |")
        return
    if args.floor:
        print_floor(args)
        return
    print("| hidden | captured | us per captured token | hooks' own count | median call, us |")
    print("|---|---|---|---|---|")
    for hidden in (128, 7168):
        for captured in (args.batch, 1):
            runs = [run(batch=args.batch, captured=captured, hidden=hidden, generations=args.generations,
                        steps=args.steps, accepted=args.accepted, cold=not args.warm, draftless=args.draftless)
                    for _ in range(args.repeats)]
            around, own = [value for value, _, _ in runs], [value for _, value, _ in runs]
            per_kind: dict[str, list[int]] = {}
            for _, _, calls in runs:
                for kind, times in calls.items():
                    per_kind.setdefault(kind, []).extend(times)
            kinds = "; ".join(f"{kind} {statistics.median(times) / 1e3:.1f}" for kind, times in per_kind.items())
            print(f"| {hidden} | {captured} of {args.batch} | {statistics.median(around):.2f} "
                  f"({min(around):.2f}-{max(around):.2f}) | {statistics.median(own):.2f} | {kinds} |")


if __name__ == "__main__":
    main()
