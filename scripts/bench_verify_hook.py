"""What a decode or verify step costs the scheduler's thread in the capture plugin, without a server.

Drives `sglang_patch.capture.CaptureAssembler` as the plugin's hooks drive it: on a replica serving an EAGLE-3
draft (`on_verify` after each verify forward, `on_verify_processed` after the scheduler processed the step,
`on_finished`) and on a draftless one (`on_decode` after each decode forward), with the two CPU copiers:
- `HostCopier`: the gather of the captured rows and their copy run on the calling (scheduler's) thread;
- `DeferredHostCopier` (the plugin's choice on CPU without a graph runner): references to the forward's outputs,
  the rows noted per request and joined on the copy thread.
Prints the scheduler thread's CPU per captured token (thread CPU time of the hook calls, the copy thread's work
not counted: it is what leaves the scheduler's thread) for a batch of `--batch` requests of which all or one are
captured, each verify step accepting `--accepted` drafts (so `--accepted + 1` tokens a step; a decode step makes
one), at the tiny target's width and at Kimi-K2.5's.

    .venv/bin/python scripts/bench_verify_hook.py [--steps 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from capture_format.tag import CaptureTag
from sglang_patch.capture import CaptureAssembler
from sglang_patch.device_copy import DeferredHostCopier, HostCopier
from sglang_patch.speculative import SpecServing
from sglang_patch.stats import CaptureStats

NUM_STEPS, NUM_DRAFT_TOKENS = 3, 4  # a chain of 3: 4 candidate rows a request, 4 on its accepted path at most
CHAIN = SpecServing(algorithm="EAGLE3", draft_path="draft", num_steps=NUM_STEPS, topk=1,
                    num_draft_tokens=NUM_DRAFT_TOKENS)
PROMPT_LEN = 16


class Req(SimpleNamespace):
    """A request as SGLang's scheduler holds it under speculative decoding (the fields the plugin reads)."""

    def __init__(self, number: int, captured: bool):
        params = {}
        if captured:
            params = CaptureTag(record_id=f"rec-{number}", sample_id=f"s-{number}", loss_spans=(),
                                mode="generate").to_custom_params()
        super().__init__(rid=f"rid-{number}", origin_input_ids=list(range(PROMPT_LEN)), output_ids=[], finished_len=None,
                         finished_reason=None, spec_verify_ct=0, cache_salt=None, input_embeds=None, mm_inputs=None,
                         sampling_params=SimpleNamespace(custom_params=params))

    def finished(self) -> bool:
        return self.finished_reason is not None


def run(copier_class, *, batch: int, captured: int, hidden: int, steps: int, accepted: int | None) -> float:
    """The scheduler thread's CPU per captured token of one generation of `steps` verify steps (accepted None:
    draftless decode steps), in us."""
    emitted: list = []
    asm = CaptureAssembler(stats=CaptureStats(), emit=emitted.append, copier=copier_class(),
                           served_draft=lambda: ("d" * 32, CHAIN))
    reqs = [Req(number, number < captured) for number in range(batch)]
    for req in reqs:
        asm.selector.on_request(req)
    aux_width = 3 * hidden  # three aux layers
    prompt_aux = torch.zeros((batch * PROMPT_LEN, aux_width), dtype=torch.bfloat16)  # (B*P, K*H)
    prompt_final = torch.zeros((batch * PROMPT_LEN, hidden), dtype=torch.bfloat16)  # (B*P, H)
    asm.on_extend(reqs, [0] * batch, [PROMPT_LEN] * batch, prompt_aux, prompt_final)
    for req in reqs:
        req.output_ids.append(1)
    asm.on_finished(reqs)
    cpu_ns = 0
    if accepted is None:  # draftless: a decode step per token
        for step in range(steps):
            aux = torch.zeros((batch, aux_width), dtype=torch.bfloat16)  # (B, K*H), allocated anew per forward
            final = torch.zeros((batch, hidden), dtype=torch.bfloat16)  # (B, H)
            started = time.thread_time_ns()
            asm.on_decode(reqs, aux, final)
            cpu_ns += time.thread_time_ns() - started
            for req in reqs:
                req.output_ids.append(2)
                if step == steps - 1:
                    req.finished_reason = SimpleNamespace()
            asm.on_finished(reqs)
        return _checked(emitted, captured, cpu_ns, steps)
    accept_index = torch.full((batch, NUM_STEPS + 1), -1, dtype=torch.int32)  # (B, W): a chain's front
    for i in range(batch):
        accept_index[i, : accepted + 1] = torch.arange(i * NUM_DRAFT_TOKENS, i * NUM_DRAFT_TOKENS + accepted + 1)
    for step in range(steps):
        # Each verify forward allocates its outputs anew on CPU (the copier keeps references to them).
        aux = torch.zeros((batch * NUM_DRAFT_TOKENS, aux_width), dtype=torch.bfloat16)  # (B*D, K*H)
        final = torch.zeros((batch * NUM_DRAFT_TOKENS, hidden), dtype=torch.bfloat16)  # (B*D, H)
        started = time.thread_time_ns()
        asm.on_verify(reqs, aux, final, accept_index.clone(), NUM_DRAFT_TOKENS)
        cpu_ns += time.thread_time_ns() - started
        for req in reqs:  # the scheduler processes the step
            req.output_ids.extend([2] * (accepted + 1))
            req.spec_verify_ct += 1
            if step == steps - 1:
                req.finished_reason = SimpleNamespace()
        started = time.thread_time_ns()
        asm.on_verify_processed(reqs, [accepted] * batch)
        cpu_ns += time.thread_time_ns() - started
        asm.on_finished(reqs)
    return _checked(emitted, captured, cpu_ns, steps * (accepted + 1))


def _checked(emitted: list, captured: int, cpu_ns: int, tokens_each: int) -> float:
    assert len(emitted) == captured, f"{len(emitted)} records emitted, {captured} captured"
    for record in emitted:
        record.states()  # waits for the copy thread: every row was copied
    return cpu_ns / 1e3 / (captured * tokens_each)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--accepted", type=int, default=2, help="drafts each step accepts (tokens a step - 1)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{args.batch} requests a verify step, {args.accepted + 1} tokens kept a step, {args.steps} steps, "
          f"median (range) of {args.repeats} runs; scheduler thread CPU us per captured token")
    print("| forward | hidden | captured | HostCopier (copy on the scheduler's thread) | DeferredHostCopier (the plugin on "
          "CPU) |")
    print("|---|---|---|---|---|")
    for accepted, forward in ((args.accepted, "verify"), (None, "decode (draftless)")):
        for hidden in (128, 7168):
            for captured in (args.batch, 1):
                cells = []
                for copier_class in (HostCopier, DeferredHostCopier):
                    values = [run(copier_class, batch=args.batch, captured=captured, hidden=hidden, steps=args.steps,
                                  accepted=accepted) for _ in range(args.repeats)]
                    cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
                print(f"| {forward} | {hidden} | {captured} of {args.batch} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
