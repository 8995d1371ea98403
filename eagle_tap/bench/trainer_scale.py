"""Trainer at scale: one training step's peak memory and tokens/s against the window, dense vs fused attention,
and the memory model that carries it to Kimi-K2.5's draft on one 141 GB GPU.

Measured (CPU, fp32, one thread, batch 1, a moderate width): each window S and form (`fused`, what training
runs: trainer/model.py's `attend` and ttt's chunked loss; `dense`, trainer/dense_reference.py: every score
materialised) in a fresh process, a whole optimizer step (forward, backward, AdamW) after one warm-up step:
the peak RSS during that step (its high-water mark reset just before) above the RSS before it (weights,
gradients and AdamW state are allocated by then), and tokens/s. Dense stops at `dense_max_window`
(quadratic: 8,192 would need ~30 GB here).

Model: the bytes autograd keeps for the backward, counted exactly (saved-tensor hooks, each storage once) at
small sizes while one width at a time changes, fitted as kept(S) = S * sum_w coefficient_w * width_w (the
widths: hidden H, intermediate I, heads x head dim A, draft vocab D, captured states K*Ht, target vocab V
through its chunk) plus the one shared (S, S) mask; under CPU bf16 autocast for the GPU's dtypes. A step's
peak = fixed (weights, gradients, AdamW, frozen: trainer/budget.py) + kept + the largest transient (one
chunk of target logits, or one TTT step's backward). The same model's kept + transient at the measured width
is printed next to each measurement (its check); at Kimi's widths it is the projection, with DDP's gradient buckets, and
with 2-way sequence parallelism (a rank keeps half the positions plus every position's first-step K/V).
"""

from __future__ import annotations

import json
import multiprocessing
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

COLUMNS = [
    ["item", "what", "s"],
    ["window", "window S", ",d"],
    ["peak_mib", "step peak (MiB)", ",.0f"],
    ["model_mib", "model (MiB)", ",.0f"],
    ["tokens_s", "tokens/s", ",.0f"],
]
GIB, MIB = 1 << 30, 1 << 20
H200_BYTES = 141e9
WIDTHS = ("hidden_size", "intermediate_size", "attention_width", "draft_vocab_size", "states_width")


@dataclass(frozen=True, kw_only=True, slots=True)
class Shape:
    """A draft and its target, as the memory model sees them."""

    hidden_size: int
    num_attention_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    """Target vocab V."""
    draft_vocab_size: int
    num_aux_hidden_states: int = 3
    ttt_steps: int = 7

    @property
    def attention_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def states_width(self) -> int:
        return self.num_aux_hidden_states * self.hidden_size


KIMI_K25 = Shape(hidden_size=7168, num_attention_heads=64, head_dim=112, intermediate_size=18432, vocab_size=163840,
                 draft_vocab_size=32000)
"""The draft `eagle-tap draft-config` derives for Kimi-K2.5 (its text config: 64 heads and KV heads, 18,432)."""


@dataclass(kw_only=True, slots=True)
class Config:
    shape: Shape = Shape(hidden_size=512, num_attention_heads=8, head_dim=64, intermediate_size=1408,
                         vocab_size=32000, draft_vocab_size=8000)
    """The measured width (the issue's probe: hidden 512, 8 heads x 64)."""
    windows: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)
    dense_max_window: int = 4096
    kimi_windows: tuple[int, ...] = (2048, 4096, 8192, 16384, 32768)
    fit_window: int = 64
    """Positions of the small runs the model's coefficients are counted from."""

    @classmethod
    def quick(cls) -> Config:
        return cls(shape=Shape(hidden_size=128, num_attention_heads=2, head_dim=64, intermediate_size=256,
                               vocab_size=2048, draft_vocab_size=512, ttt_steps=3),
                   windows=(128, 256), dense_max_window=256, fit_window=32)


def build(shape: Shape, frozen_dtype: Any = None):
    """A random Eagle3Objective of this shape (weights on the current default device)."""
    import torch

    from trainer import model, ttt

    config = model.Config(hidden_size=shape.hidden_size, target_hidden_size=shape.hidden_size,
                          num_aux_hidden_states=shape.num_aux_hidden_states,
                          num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_attention_heads,
                          head_dim=shape.head_dim, intermediate_size=shape.intermediate_size, rms_norm_eps=1e-5,
                          vocab_size=shape.vocab_size, draft_vocab_size=shape.draft_vocab_size,
                          max_position_embeddings=1 << 18)
    frozen_dtype = frozen_dtype or torch.float32
    draft = model.Eagle3Draft(config, frozen_dtype=frozen_dtype)
    with torch.no_grad():
        draft.t2d[: shape.draft_vocab_size] = True  # draft ids 0..D-1 (d2t offsets 0)
    head = torch.randn(shape.vocab_size, shape.hidden_size, dtype=frozen_dtype)  # (V, H)
    return ttt.Eagle3Objective(draft, head, ttt.Config(ttt_steps=shape.ttt_steps))


def synthetic_batch(shape: Shape, S: int, dtype: Any = None) -> dict:
    """One row of two packed records (S/2 each), learned everywhere: the block-causal mask is exercised."""
    import torch

    generator = torch.Generator().manual_seed(S)
    half = S // 2
    doc_ids = torch.cat([torch.zeros(half, dtype=torch.long), torch.ones(S - half, dtype=torch.long)])[None]  # (1, S)
    positions = torch.cat([torch.arange(half), torch.arange(S - half)])[None]  # (1, S)
    return {"aux": torch.randn(1, S, shape.states_width, generator=generator, dtype=dtype),
            "final": torch.randn(1, S, shape.hidden_size, generator=generator, dtype=dtype) * 4,
            "input_ids": torch.randint(0, shape.vocab_size, (1, S), generator=generator), "position_ids": positions,
            "loss_mask": torch.ones(1, S, dtype=torch.bool), "doc_ids": doc_ids}


def _measure_step(shape: Shape, S: int, form: str, queue: Any) -> None:
    """In a fresh process: one warm-up and one measured optimizer step; peak RSS growth and seconds."""
    import contextlib

    import torch

    from trainer.dense_reference import dense_objective

    torch.set_num_threads(1)
    torch.manual_seed(0)
    objective = build(shape)
    optimizer = torch.optim.AdamW([p for p in objective.draft.parameters() if p.requires_grad], lr=1e-4)
    context = dense_objective if form == "dense" else contextlib.nullcontext
    warmup = synthetic_batch(shape, min(S, 128))
    with context():
        for batch in (warmup, synthetic_batch(shape, S)):  # the second one is measured
            before_kib = _reset_peak_kib()
            started = time.perf_counter()
            objective(batch)["loss"].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            seconds = time.perf_counter() - started
    queue.put({"peak_bytes": (_status_kib("VmHWM") - before_kib) * 1024, "seconds": seconds})


def _reset_peak_kib() -> int:
    """Resets this process's peak RSS to its RSS now (Linux: clear_refs 5) and returns that RSS."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return _status_kib("VmRSS")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(f"{field}:"))


def measure_step(shape: Shape, S: int, form: str) -> dict[str, float]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_measure_step, args=(shape, S, form, queue))
    process.start()
    result = queue.get(timeout=3600)
    process.join()
    return result


def kept_bytes(shape: Shape, S: int, autocast: bool) -> int:
    """Bytes autograd keeps for the backward over one forward (each storage once): exact, this process."""
    import torch

    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    torch.manual_seed(0)
    objective = build(shape, torch.bfloat16 if autocast else torch.float32)
    batch = synthetic_batch(shape, S, torch.bfloat16 if autocast else torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        objective(batch)
    return sum(kept.values())


@dataclass(frozen=True, slots=True)
class MemoryModel:
    per_position: dict[str, float]
    """Kept bytes per position per unit of each width (all TTT steps)."""
    mask_bytes: int
    """Bytes per element of the (S, S) mask the steps share (fp32 on CPU, bf16 under autocast)."""
    bytes_per_value: int
    """Activation element size: 4 (fp32) or 2 (bf16)."""

    def kept(self, shape: Shape, S: int, keys: int | None = None) -> float:
        """Kept over S positions whose queries see `keys` positions (S; more under sequence parallelism)."""
        linear = sum(coefficient * getattr(shape, width) for width, coefficient in self.per_position.items())
        return S * linear + self.mask_bytes * S * (S if keys is None else keys)

    def transient(self, shape: Shape, S: int) -> float:
        """The largest temporary on top of what is kept: a chunk of fp32 target logits (and its low-precision
        product) or one TTT step's backward (about one step's kept activations)."""
        rows = min(S, 4096)
        target_chunk = rows * shape.vocab_size * (4 + self.bytes_per_value)
        one_step = self.kept(shape, S) / shape.ttt_steps
        return max(target_chunk, one_step)

    def peak(self, shape: Shape, S: int, fixed_bytes: float) -> float:
        return fixed_bytes + self.kept(shape, S) + self.transient(shape, S)


def fit_memory_model(shape: Shape, S: int, autocast: bool) -> MemoryModel:
    """Coefficients per width from exact kept-byte counts: the base shape, then each width doubled alone."""
    import numpy as np

    element = 2 if autocast else 4
    shapes = [shape]
    for width in WIDTHS:
        bigger = replace(shape, hidden_size=shape.hidden_size * (2 if width == "hidden_size" else 1),
                         intermediate_size=shape.intermediate_size * (2 if width == "intermediate_size" else 1),
                         num_attention_heads=shape.num_attention_heads * (2 if width == "attention_width" else 1),
                         draft_vocab_size=shape.draft_vocab_size * (2 if width == "draft_vocab_size" else 1),
                         num_aux_hidden_states=shape.num_aux_hidden_states * (2 if width == "states_width" else 1))
        shapes.append(bigger)
    mask_bytes = element
    rows = np.array([[getattr(each, width) for width in WIDTHS] for each in shapes], dtype=np.float64)
    # Per position: the difference between 2S and S positions, less the mask's growth (weights cancel).
    kept = np.array([(kept_bytes(each, 2 * S, autocast) - kept_bytes(each, S, autocast) - mask_bytes * 3 * S * S) / S
                     for each in shapes])
    coefficients, *_ = np.linalg.lstsq(rows, kept, rcond=None)
    return MemoryModel(per_position=dict(zip(WIDTHS, coefficients.tolist())), mask_bytes=mask_bytes,
                       bytes_per_value=element)


def budget_of(shape: Shape, frozen_dtype: Any):
    """trainer.budget.MemoryBudget of this shape, counted on the meta device (nothing allocated)."""
    import torch

    from trainer.budget import memory_budget

    with torch.device("meta"):
        return memory_budget(build(shape, frozen_dtype))


def run(config: Config) -> dict[str, Any]:
    import torch

    shape = config.shape
    cpu_model = fit_memory_model(shape, config.fit_window, autocast=False)
    gpu_model = fit_memory_model(shape, config.fit_window, autocast=True)
    rows, measured = [], {}
    for form in ("dense", "fused"):
        for S in config.windows:
            if form == "dense" and S > config.dense_max_window:
                continue
            result = measure_step(shape, S, form)
            measured[(form, S)] = result["peak_bytes"]
            # The measured step starts with weights, gradients and AdamW state allocated: it adds kept + transient.
            model_bytes = cpu_model.kept(shape, S) + cpu_model.transient(shape, S) if form == "fused" else None
            rows.append({"item": f"{form}, CPU fp32", "window": S, "peak_mib": result["peak_bytes"] / MIB,
                         "model_mib": None if model_bytes is None else model_bytes / MIB,
                         "tokens_s": S / result["seconds"]})
    # Under autocast the forward also holds a bf16 copy of every trained weight (autocast's cast cache).
    kimi_budget = budget_of(KIMI_K25, torch.bfloat16)
    kimi_fixed = kimi_budget.fixed_bytes + kimi_budget.num_trained * 2
    kimi_gradients = kimi_budget.ddp_bucket_bytes
    projection = {}
    for S in config.kimi_windows:
        ddp = gpu_model.peak(KIMI_K25, S, kimi_fixed + kimi_gradients)
        # 2-way sequence parallel (one replica, no DDP buckets): half the positions, each seeing all S keys, and
        # the whole window's first-step K and V gathered once (every step shares them).
        gathered = 2 * KIMI_K25.attention_width * S * gpu_model.bytes_per_value
        sequence_parallel = (kimi_fixed + gpu_model.kept(KIMI_K25, S // 2, keys=S) + gathered
                             + gpu_model.transient(KIMI_K25, S // 2))
        projection[S] = {"ddp_gib": ddp / GIB, "sequence_parallel_2_gib": sequence_parallel / GIB,
                         "fits_ddp": ddp < H200_BYTES, "fits_sequence_parallel_2": sequence_parallel < H200_BYTES}
        rows.append({"item": "fused, Kimi-K2.5 draft on a GPU (model, DDP)", "window": S, "peak_mib": None,
                     "model_mib": ddp / MIB, "tokens_s": None})
    fused = {S: measured[("fused", S)] for S in config.windows if ("fused", S) in measured}
    largest, base = max(fused), min(config.windows, key=lambda S: abs(S - max(fused) // 4))
    growth = fused[largest] / fused[base] if base in fused and base != largest else None
    checks = [row["peak_mib"] / row["model_mib"] for row in rows if row.get("model_mib") and row.get("peak_mib")]
    notes = [
        f"Shape measured: {json.dumps(asdict(shape))}; batch 1 (two packed records); one thread; fp32.",
        f"Fused peak at {largest:,} over its peak at {base:,}: {growth:.2f}x (linear: 4x)" if growth else
        "Too few windows to compare growth.",
        f"Model check (measured / model, fused, CPU): {min(checks):.2f}-{max(checks):.2f}." if checks else "",
        "Kimi-K2.5 draft (hidden 7168, 64 x 112 heads, intermediate 18,432, draft vocab 32,000, target vocab "
        f"163,840, 7 TTT steps, bf16 autocast, fp32 master weights and AdamW): fixed {kimi_fixed / GIB:.1f} GiB + "
        f"{kimi_gradients / GIB:.1f} GiB DDP buckets per rank; per window (GiB, DDP / 2-way sequence parallel): "
        + ", ".join(f"{S:,}: {p['ddp_gib']:.0f} / {p['sequence_parallel_2_gib']:.0f}" for S, p in projection.items())
        + f" against {H200_BYTES / 1e9:.0f} GB.",
        "The GPU figures are a model, not a measurement: scripts/gpu_check_trainer.py measures them on a GPU.",
    ]
    return {"title": "Trainer at scale: step memory and speed against the window", "parameters": asdict(config),
            "columns": COLUMNS, "rows": rows,
            "summary": {"fused_growth": growth, "model_check": [min(checks), max(checks)] if checks else None,
                        "kimi_projection": {str(S): p for S, p in projection.items()},
                        "cpu_model": cpu_model.per_position, "gpu_model": gpu_model.per_position},
            "notes": [note for note in notes if note]}

