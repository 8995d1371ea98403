"""Times one EAGLE-3 training step of a Kimi-K2.5-sized draft on one GPU and checks its bf16 loss (plain torch only).

It prints the fixed memory budget (fp32 trainable weights, gradients, AdamW state; bf16 frozen embedding and
target lm_head), then per window length S (`--windows`): tokens/s of a full step (the 7-step TTT unroll of
trainer/ttt.py, backward, fused AdamW) after one warm-up step, MFU against `--peak-tflops` (H200 bf16 dense:
989), peak GPU memory and the loss. A window that does not fit is reported as OOM, and the next one is tried.

What must hold (exit 0, last line `OK`; else exit 1, `FAILED: <why>`):
- at a small size, the loss of the run's mode on the run's device (fp32 master weights, bf16 frozen weights and
  inputs, bf16 autocast) is within 2e-2 (relative) of the same weights and batch in fp32 on the CPU (1e-5 when
  the run itself is fp32 on the CPU), and the flattened gradients point the same way (cosine > 0.99);
- the first window runs (a larger one may be OOM: reported, not a failure).
The reference side of the check is the objective's dense form (trainer/dense_reference.py), so the check covers
the attention the run takes: `--attention fused` (the default, what training runs: trainer/attention.py, the kernel's
own log-sum-exp) or `--attention chunked` (trainer.model.chunked_attend, the log-sum-exp recomputed over query
chunks), to time the two side by side at the same windows.

On the GPU machine, from the repo root (only PyTorch needed; about 2-3 minutes):

    python scripts/gpu_check_trainer.py [--windows 2048,4096,8192] [--attention chunked] [--json results.json]

On a CPU (`--quick`, or `--device cpu` with small sizes) it only checks that the script runs.
Shape legend: B rows, S positions, H hidden, K capture layers, V target vocab, D draft vocab.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import math
import resource
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer import model, ttt  # noqa: E402
from trainer.budget import memory_budget  # noqa: E402
from trainer.dense_reference import dense_objective  # noqa: E402

GIB = 2**30
ATTENTION_FORMS = {"fused": model.attend, "chunked": model.chunked_attend}
"""`--attention`: the draft attention's form at TTT steps after the first (trainer.model)."""
KIMI_SIZE = dict(hidden_size=7168, heads=64, kv_heads=64, head_dim=112, intermediate_size=18432, vocab_size=163840,
                 draft_vocab_size=32000)
"""Kimi-K2.5's hidden size and vocab (V: the target's, its embedding rows), SGLang's draft shapes for it."""
CHECK_SIZE = dict(hidden_size=256, heads=4, kv_heads=4, head_dim=64, intermediate_size=512, vocab_size=2048,
                  draft_vocab_size=512)
KIMI_MLA = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
"""`--layout mla`: Kimi-K2.5's own attention shapes, which `draft-config --layout mla` copies into the draft."""
CHECK_MLA = dict(q_lora_rank=48, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
QUICK = {**CHECK_SIZE, "windows": "64,128", "steps": 1}
CHECK_WINDOW, CHECK_TTT_STEPS = 256, 3
LOSS_TOLERANCE_BF16, LOSS_TOLERANCE_FP32, MIN_GRADIENT_COSINE = 2e-2, 1e-5, 0.99
TARGET_LOGIT_STD = 2.0
"""Spread of the synthetic target logits: a peaked, not uniform, target distribution at any hidden size."""


def draft_config(*, hidden_size, heads, kv_heads, head_dim, intermediate_size, vocab_size, draft_vocab_size,
                 layout="llama", mla=None, **_) -> model.Config:
    """The Llama layout, or with layout "mla" the MLA one with `mla`'s shapes (KIMI_MLA, CHECK_MLA)."""
    return model.Config(
        layout=layout, **(mla if layout == "mla" else {}),
        hidden_size=hidden_size, target_hidden_size=hidden_size, num_aux_hidden_states=3,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        intermediate_size=intermediate_size, rms_norm_eps=1e-5, vocab_size=vocab_size,
        draft_vocab_size=draft_vocab_size, max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0})


def build_objective(config: model.Config, ttt_steps: int, device: torch.device, frozen_dtype: torch.dtype,
                    seed: int) -> ttt.Eagle3Objective:
    """The draft's own random init (fp32, trainable) with a random frozen embedding and target lm_head made
    directly in frozen_dtype on the device. The draft vocab is the first D target ids, and t2d marks every target id
    as in it: every loss-masked row is learned, so no row's weight hinges on a bf16 argmax (a flip of one row moves
    the small check's gradient by ~1/sqrt(rows)); the step's cost is the same."""
    torch.manual_seed(seed)
    with torch.device(device):
        draft = model.Eagle3Draft(config, frozen_dtype=frozen_dtype)
    V = config.vocab_size
    with torch.no_grad():
        draft.embed_tokens.weight.normal_(0.0, 0.02)  # (V, H), frozen_dtype
    target_lm_head = torch.randn(V, config.target_hidden_size, dtype=frozen_dtype, device=device).mul_(0.02)  # (V, H)
    with torch.no_grad():
        draft.t2d.fill_(True)  # d2t stays 0: draft id i is target id i
    return ttt.Eagle3Objective(draft, target_lm_head, ttt.Config(ttt_steps=ttt_steps))


def make_batch(config: model.Config, batch_size: int, S: int, device: torch.device, float_dtype: torch.dtype,
               seed: int) -> dict[str, torch.Tensor]:
    """What Eagle3Objective reads: two records packed per row (block-causal mask), the first quarter of each a
    prompt (not loss-masked); final states whose target logits have std ~TARGET_LOGIT_STD."""
    generator = torch.Generator(device=device).manual_seed(seed)
    B, K, Ht = batch_size, config.num_aux_hidden_states, config.target_hidden_size
    split = S // 3
    positions = torch.arange(S, device=device)  # (S,)
    doc_ids = (positions >= split).long().expand(B, S).contiguous()  # (B, S)
    position_ids = positions - split * doc_ids  # (B, S)
    record_length = torch.where(doc_ids == 0, split, S - split)  # (B, S)
    final_std = TARGET_LOGIT_STD / (0.02 * math.sqrt(Ht))
    return {
        "aux": torch.randn(B, S, K * Ht, generator=generator, device=device, dtype=float_dtype),  # (B, S, K*Ht)
        "final": torch.randn(B, S, Ht, generator=generator, device=device, dtype=float_dtype).mul_(final_std),
        "input_ids": torch.randint(0, config.vocab_size, (B, S), generator=generator, device=device),  # (B, S)
        "position_ids": position_ids,
        "loss_mask": position_ids >= record_length // 4,  # (B, S) bool
        "doc_ids": doc_ids,
    }


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def trainable(objective: ttt.Eagle3Objective) -> list[nn.Parameter]:
    return [p for p in objective.parameters() if p.requires_grad]


def budget(objective: ttt.Eagle3Objective) -> dict[str, float]:
    """Memory held whatever the window (trainer.budget, what `eagle-tap train` logs at its start), in GiB."""
    counted = memory_budget(objective)
    return {"trainable_params": counted.num_trained, "trainable_gib": counted.trained_bytes / GIB,
            "frozen_params": counted.num_frozen, "frozen_dtype": str(objective.target_lm_head.dtype)[len("torch."):],
            "frozen_gib": counted.frozen_bytes / GIB, "gradient_gib": counted.gradient_bytes / GIB,
            "adamw_gib": counted.optimizer_bytes / GIB, "total_fixed_gib": counted.fixed_bytes / GIB}


def flops_per_token(config: model.Config, S: int, ttt_steps: int) -> float:
    """Model FLOPs of one step per token: fc once and the layer + lm_head at every TTT step (6 x params, forward and
    backward), attention over ~S/2 causal keys per step (2 x keys x N x (query-key width + value width) forward, x3
    with backward), and the frozen target lm_head's forward over V (once per batch). The MLA layer is counted as
    the trainer computes it: per-head keys and values decompressed from the latent (kv_b_proj on every row)."""
    c = config
    fc = c.num_aux_hidden_states * c.target_hidden_size * c.hidden_size
    # The layer's input is 2H wide (the embedding and the hidden, concatenated) for q and for k/v.
    if c.layout == "mla":
        qk_width, value_width = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
        attention = (2 * c.hidden_size * c.q_lora_rank + c.q_lora_rank * c.num_attention_heads * qk_width
                     + 2 * c.hidden_size * (c.kv_lora_rank + c.qk_rope_head_dim)
                     + c.kv_lora_rank * c.num_attention_heads * (c.qk_nope_head_dim + value_width)
                     + c.num_attention_heads * value_width * c.hidden_size)
    else:
        qk_width = value_width = c.head_dim
        attention = 2 * c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim \
            + c.num_attention_heads * c.head_dim * c.hidden_size
    per_step = attention + 3 * c.hidden_size * c.intermediate_size + c.draft_vocab_size * c.hidden_size
    attention_scores = 3 * 2 * (S / 2) * c.num_attention_heads * (qk_width + value_width)
    return 6 * fc + ttt_steps * (6 * per_step + attention_scores) + 2 * c.vocab_size * c.target_hidden_size


def train_step(objective: ttt.Eagle3Objective, optimizer: torch.optim.Optimizer, batch: dict) -> float:
    with autocast(batch["aux"].device):
        loss = objective(batch)["loss"]
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def measure_window(objective, optimizer, config, args, S: int, device: torch.device) -> dict:
    """One warm-up step, then the mean of `args.steps` timed steps on one synthetic batch of window S."""
    batch = make_batch(config, args.batch_size, S, device, torch.bfloat16 if device.type == "cuda" else torch.float32,
                       args.seed + S)
    rss_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    train_step(objective, optimizer, batch)  # warm-up (and, at the first window, AdamW's state)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda device: None
    losses, times_s = [], []
    for _ in range(args.steps):
        synchronize(device)
        started = time.perf_counter()
        losses.append(train_step(objective, optimizer, batch))
        synchronize(device)
        times_s.append(time.perf_counter() - started)
    step_s = sum(times_s) / len(times_s)
    flops = flops_per_token(config, S, args.ttt_steps) * args.batch_size * S
    if device.type == "cuda":
        peak_gib = torch.cuda.max_memory_allocated(device) / GIB
    else:  # RSS high-water growth in this window (Linux: KiB); 0 once an earlier window set the mark higher
        peak_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before_kib) / 2**20
    return {"window": S, "oom": False, "step_s": step_s, "tokens_per_s": args.batch_size * S / step_s,
            "mfu": flops / step_s / (args.peak_tflops * 1e12) if device.type == "cuda" else None,
            "flops_per_token": flops / (args.batch_size * S), "peak_gib": peak_gib, "loss": losses[-1]}


def loss_and_gradient(objective: ttt.Eagle3Objective, batch: dict) -> tuple[float, torch.Tensor]:
    with autocast(batch["aux"].device):
        loss = objective(batch)["loss"]
        loss.backward()
    return loss.item(), torch.cat([p.grad.float().flatten().cpu() for p in trainable(objective)])


def check_correctness(device: torch.device, seed: int, layout: str = "llama") -> dict:
    """The run's mode on the run's device against fp32 on the CPU: same weights (frozen ones rounded to the run's
    dtype first, so both read the same values), same batch."""
    config = draft_config(**CHECK_SIZE, layout=layout, mla=CHECK_MLA)
    run_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    built = build_objective(config, CHECK_TTT_STEPS, torch.device("cpu"), run_dtype, seed)
    batch = make_batch(config, 1, CHECK_WINDOW, torch.device("cpu"), run_dtype, seed)
    reference = copy.deepcopy(built)
    reference.draft.embed_tokens.weight = nn.Parameter(built.draft.embed_tokens.weight.float(), requires_grad=False)
    reference.target_lm_head = built.target_lm_head.float()  # (V, H)
    with dense_objective():
        reference_loss, reference_gradient = loss_and_gradient(
            reference, {k: v.float() if v.is_floating_point() else v for k, v in batch.items()})
    run_loss, run_gradient = loss_and_gradient(copy.deepcopy(built).to(device),
                                               {k: v.to(device) for k, v in batch.items()})
    tolerance = LOSS_TOLERANCE_BF16 if run_dtype == torch.bfloat16 else LOSS_TOLERANCE_FP32
    relative = abs(run_loss - reference_loss) / abs(reference_loss)
    cosine = F.cosine_similarity(run_gradient.double(), reference_gradient.double(), dim=0).item()
    return {"reference_loss_fp32_cpu": reference_loss, "run_loss": run_loss, "relative_difference": relative,
            "tolerance": tolerance, "gradient_cosine": cosine,
            "passed": relative <= tolerance and cosine > MIN_GRADIENT_COSINE and math.isfinite(run_loss)}


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in KIMI_SIZE.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    parser.add_argument("--layout", choices=("llama", "mla"), default="llama",
                        help="the draft layer's attention: llama (GQA) or mla (KIMI_MLA's shapes: Kimi-K2.5's)")
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--windows", default="2048,4096,8192", help="window lengths S to measure, comma-separated")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per window, after one warm-up")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="peak bf16 dense TFLOP/s (H200: 989)")
    parser.add_argument("--attention", choices=tuple(ATTENTION_FORMS), default="fused",
                        help="the attention of TTT steps after the first: fused (the kernel's log-sum-exp, what "
                             "training runs) or chunked (the log-sum-exp recomputed over query chunks)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--quick", action="store_true", help="a small size for a CPU smoke run: " + str(QUICK))
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**QUICK)  # explicit options still win
    args = parser.parse_args(argv)
    fused, model.attend = model.attend, ATTENTION_FORMS[args.attention]  # the check's run side and every window
    try:
        return run(args, started)
    finally:
        model.attend = fused


def run(args: argparse.Namespace, started: float) -> int:
    windows = [int(w) for w in args.windows.split(",")]
    device = torch.device(args.device)
    config = draft_config(**vars(args), mla=KIMI_MLA)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, attention {args.attention}")
    size = "Kimi-K2.5 size" if all(getattr(args, k) == v for k, v in KIMI_SIZE.items()) else "reduced size"
    print(f"{size}: hidden {config.hidden_size}, heads {config.num_attention_heads} x {config.head_dim} (kv "
          f"{config.num_key_value_heads}), intermediate {config.intermediate_size}, vocab {config.vocab_size}, "
          f"draft vocab {config.draft_vocab_size}, ttt steps {args.ttt_steps}, batch {args.batch_size}")
    if config.layout == "mla":
        print("mla layout: " + ", ".join(f"{key} {value}" for key, value in KIMI_MLA.items()))

    check = check_correctness(device, args.seed, args.layout)
    check_line = (f"relative loss difference {check['relative_difference']:.2e} (tolerance {check['tolerance']:.0e}),"
                  f" gradient cosine {check['gradient_cosine']:.5f} (needs > {MIN_GRADIENT_COSINE})")
    print(f"check (hidden {CHECK_SIZE['hidden_size']}, S={CHECK_WINDOW}, ttt {CHECK_TTT_STEPS}): loss fp32 cpu "
          f"{check['reference_loss_fp32_cpu']:.6f}, run {check['run_loss']:.6f}; {check_line}")

    frozen_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    objective = build_objective(config, args.ttt_steps, device, frozen_dtype, args.seed)
    optimizer = torch.optim.AdamW(trainable(objective), lr=1e-4, fused=device.type == "cuda")
    fixed = budget(objective)
    print(f"trainable {fixed['trainable_params']:,} params, {fixed['trainable_gib']:.3f} GiB fp32; frozen (embedding "
          f"+ target lm_head) {fixed['frozen_params']:,} params, {fixed['frozen_gib']:.3f} GiB {fixed['frozen_dtype']}")
    print(f"gradients {fixed['gradient_gib']:.3f} GiB, AdamW state {fixed['adamw_gib']:.3f} GiB, "
          f"total fixed {fixed['total_fixed_gib']:.3f} GiB")

    results = []
    for S in windows:
        try:
            results.append(measure_window(objective, optimizer, config, args, S, device))
        except torch.cuda.OutOfMemoryError:
            results.append({"window": S, "oom": True})
        last = results[-1]
        print(f"window {S}: " + ("OOM" if last["oom"] else f"{last['step_s']:.3f} s a step"), flush=True)
        optimizer.zero_grad(set_to_none=True)  # after an OOM mid-step, free what the failed step left
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("\n| window | tokens/s | MFU | peak GiB | loss |\n|---:|---:|---:|---:|---:|")
    for r in results:
        mfu = "n/a" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
        print(f"| {r['window']} | OOM | | | |" if r["oom"] else
              f"| {r['window']} | {r['tokens_per_s']:,.0f} | {mfu} | {r['peak_gib']:.2f} | {r['loss']:.4f} |")

    failures = [] if check["passed"] else [f"correctness check: {check_line}"]
    if results[0]["oom"]:
        failures.append(f"the first window ({windows[0]}) ran out of memory")
    failures += [f"window {r['window']}: loss {r['loss']}" for r in results
                 if not r["oom"] and not math.isfinite(r["loss"])]
    wall_s = time.perf_counter() - started
    print(f"\nwall time {wall_s:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({
            "device": args.device, "torch": torch.__version__, "attention": args.attention,
            "draft": dataclasses.asdict(config), "ttt_steps": args.ttt_steps, "batch_size": args.batch_size,
            "steps": args.steps, "budget": fixed, "windows": results, "check": check, "passed": not failures,
            "wall_s": wall_s}, indent=2))
    print("OK" if not failures else "FAILED: " + "; ".join(failures))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
