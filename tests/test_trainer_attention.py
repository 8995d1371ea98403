"""The objective's fused attention and chunked loss equal their dense forms (trainer/dense_reference.py),
and keep no tensor quadratic in the window for the backward.

Equal: loss, per-step losses and counts, and every gradient, for packed records with padding, a window
that starts inside a record (its first rows masked, as trainer/data.py windows are), GQA, all TTT steps,
with the log-sum-exp and the loss both forced into several chunks. Sequence parallelism on 2 gloo ranks
against the dense form: tests/test_trainer_sequence_parallel.py. The merge through the attention kernel's own
log-sum-exp (trainer/attention.py) is what the fp32 objective takes, and is checked alone against autograd.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from trainer import attention, model, ttt
from trainer.attention import chain_attention
from trainer.dense_reference import dense_attend, dense_objective, dense_soft_cross_entropy

TTT_STEPS = 7


def objective(dtype: torch.dtype, loss_chunk_rows: int) -> ttt.Eagle3Objective:
    torch.manual_seed(0)
    config = model.Config(hidden_size=32, target_hidden_size=16, num_aux_hidden_states=3, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, intermediate_size=64, rms_norm_eps=1e-6, vocab_size=96,
                          draft_vocab_size=48, max_position_embeddings=256)
    draft = model.Eagle3Draft(config)
    draft_ids = torch.randperm(96)[:48].sort().values  # (D,)
    with torch.no_grad():
        draft.embed_tokens.weight.normal_()
        draft.d2t.copy_(draft_ids - torch.arange(48))
        draft.t2d[draft_ids] = True
    head = torch.randn(96, 16) * 3  # (V, H): peaked targets, so the loss is far from uniform
    config = ttt.Config(ttt_steps=TTT_STEPS, step_weight=0.8, loss_chunk_rows=loss_chunk_rows)
    return ttt.Eagle3Objective(draft, head, config).to(dtype)


def batch(dtype: torch.dtype) -> dict:
    """Row 0: records of 9 and 14 rows, then 3 of padding. Row 1: a window that starts 6 rows into a record
    (those rows masked: the window before holds their targets), positions continuing from 30."""
    generator = torch.Generator().manual_seed(1)
    S = 26
    doc_ids = torch.tensor([[0] * 9 + [1] * 14 + [-1] * 3, [2] * S])  # (2, S)
    loss_mask = (torch.rand(2, S, generator=generator) < 0.8) & (doc_ids >= 0)  # (2, S)
    loss_mask[1, :6] = False
    positions = torch.stack([torch.cat([torch.arange(9), torch.arange(14), torch.zeros(3, dtype=torch.long)]),
                             torch.arange(S) + 30])  # (2, S)
    return {"aux": torch.randn(2, S, 48, generator=generator, dtype=dtype),
            "final": torch.randn(2, S, 16, generator=generator, dtype=dtype),
            "input_ids": torch.randint(0, 96, (2, S), generator=generator), "position_ids": positions,
            "loss_mask": loss_mask, "doc_ids": doc_ids}


def step(dtype: torch.dtype, loss_chunk_rows: int = 5) -> dict[str, torch.Tensor]:
    unroll = objective(dtype, loss_chunk_rows)
    out = unroll(batch(dtype))
    out["loss"].backward()
    result = {name: out[name].detach() for name in ("loss", "step_losses", "correct", "total")}
    return result | {f"grad.{name}": p.grad for name, p in unroll.draft.named_parameters() if p.grad is not None}


def test_the_fused_objective_equals_the_dense_one(monkeypatch) -> None:
    """In fp32, as training on CPU runs (the objective computes its targets and norms in fp32 whatever the
    weights' dtype); float rounding apart, the same numbers."""
    monkeypatch.setattr(model, "SCORE_CHUNK_BYTES", 4 * 2 * 4 * 26 * 7)  # the log-sum-exp in 4 chunks of 7 queries
    fused = step(torch.float32)
    with dense_objective():
        assert model.attend is dense_attend and ttt.soft_cross_entropy is dense_soft_cross_entropy
        dense = step(torch.float32)
    assert model.attend is not dense_attend and ttt.soft_cross_entropy is not dense_soft_cross_entropy
    assert fused["total"].tolist()[-1] > 0 and len([name for name in fused if name.startswith("grad.")]) == 13
    assert fused.keys() == dense.keys()
    for name, value in dense.items():
        torch.testing.assert_close(fused[name], value, rtol=1e-5, atol=1e-6, msg=lambda message: f"{name}: {message}")


def test_attention_alone_equals_the_dense_form_at_every_step_with_several_key_blocks() -> None:
    torch.manual_seed(2)
    B, N, S, E = 2, 4, 23, 8
    doc_ids = torch.tensor([[0] * 10 + [1] * 13, [0] * 23])  # (B, S)
    mask = model.causal_mask(doc_ids)  # (B, 1, S, S)
    cache = []
    for num_steps in range(1, TTT_STEPS + 1):
        cache.append(tuple(torch.randn(B, N, S, E, dtype=torch.float64, requires_grad=True) for _ in range(2)))
        q = torch.randn(B, N, S, E, dtype=torch.float64, requires_grad=True)
        inputs = [q, *(x for pair in cache for x in pair)]
        got, want = (attend(q, cache, mask, 0.3) for attend in (model.attend, dense_attend))  # (B, N, S, E) each
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        probe = torch.randn_like(want)
        for a, b in zip(torch.autograd.grad((got * probe).sum(), inputs),
                        torch.autograd.grad((want * probe).sum(), inputs), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda message: f"{num_steps} steps: {message}")


def saved_bytes(S: int, checkpoint_steps: bool = False) -> dict[str, int]:
    """Per form (fused, dense): bytes of the storages autograd keeps for the backward in one forward of the
    objective over a window of S positions (two rows, one record each), each storage counted once."""
    window = {key: value.repeat(1, -(-S // 26), *([1] * (value.dim() - 2)))[:, :S]
              for key, value in batch(torch.float32).items()}
    window["doc_ids"] = torch.zeros(2, S, dtype=torch.long)
    saved = {}
    for form, context in (("fused", contextlib.nullcontext), ("dense", dense_objective)):
        kept: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        unroll = objective(torch.float32, 1024)
        unroll.config.checkpoint_steps = checkpoint_steps
        with context(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            unroll(window)
        saved[form] = sum(kept.values())
    return saved


def test_what_is_kept_for_the_backward_grows_by_one_shared_mask_per_window_squared() -> None:
    """Kept bytes are b + a*S + c*S^2 (b: weights): c is 4 B per row (one fp32 (B, 1, S, S) mask all steps
    share) in the fused form, and about 4 B per row, head and step (each step's scores) in the dense one."""
    B, N, S = 2, 4, 96
    kept = [saved_bytes(size) for size in (S, 2 * S, 4 * S)]
    # t(4S) - 3 t(2S) + 2 t(S) = 6 c S^2: b and a cancel.
    per_square = {form: (kept[2][form] - 3 * kept[1][form] + 2 * kept[0][form]) / (6 * S * S) for form in kept[0]}
    assert per_square["dense"] >= 0.9 * 4 * B * N * TTT_STEPS, per_square  # the check can fail
    assert per_square["fused"] == 4 * B, per_square


def test_checkpointed_steps_give_the_same_step_and_keep_less() -> None:
    plain = step(torch.float32)
    unroll = objective(torch.float32, 5)
    unroll.config.checkpoint_steps = True
    out = unroll(batch(torch.float32))
    out["loss"].backward()
    checkpointed = {name: out[name].detach() for name in ("loss", "step_losses", "correct", "total")} | {
        f"grad.{name}": p.grad for name, p in unroll.draft.named_parameters() if p.grad is not None}
    assert checkpointed.keys() == plain.keys()
    for name, value in plain.items():
        torch.testing.assert_close(checkpointed[name], value, rtol=1e-6, atol=1e-7, msg=lambda message: f"{name}: {message}")
    S = 192
    assert saved_bytes(S, checkpoint_steps=True)["fused"] < 0.6 * saved_bytes(S)["fused"]


def test_the_objective_merges_through_the_kernels_log_sum_exp_at_every_later_step(monkeypatch) -> None:
    """The fp32 comparison above runs trainer/attention.py's merge, not the chunked fallback (fp64 takes that)."""
    calls = {"count": 0}

    def counted(*args):
        calls["count"] += 1
        return chain_attention(*args)

    monkeypatch.setattr(attention, "chain_attention", counted)
    step(torch.float32)
    assert calls["count"] == TTT_STEPS - 1
    step(torch.float64)
    assert calls["count"] == TTT_STEPS - 1


def dense_chain_attention(q, k0, v0, mask, k_chain, v_chain, scale) -> torch.Tensor:
    """chain_attention's result through one softmax over materialised scores, for autograd to differentiate."""
    scores = model.masked((q @ k0.transpose(-1, -2)) * scale, mask)  # (B, N, S, T)
    chain_scores = (q.unsqueeze(3) * k_chain).sum(-1) * scale  # (B, N, S, J)
    probs = torch.cat([scores, chain_scores], dim=-1).softmax(-1)  # (B, N, S, T + J)
    T = k0.shape[2]
    return probs[..., :T] @ v0 + (probs[..., T:].unsqueeze(-1) * v_chain).sum(3)  # (B, N, S, Ev)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("value_width", [8, 6, 12])  # as wide as q and k, narrower (MLA), wider
def test_the_kernel_merge_and_its_backward_equal_autograd_through_the_dense_softmax(dtype, value_width) -> None:
    """Outputs and every gradient (dq, dk0, dv0, dk_chain, dv_chain), with rows that see one key of k0 (a record's
    first), a row that sees none (its chain only: finite, no NaN) and keys beyond the queries (T > S)."""
    torch.manual_seed(3)
    B, N, S, T, J, E = 2, 3, 11, 15, 4, 8
    doc_ids = torch.tensor([[0] * 4 + [1] * 11, [2] * 15])  # (B, T): queries are the last S positions
    mask = model.causal_mask(doc_ids)[:, :, T - S:]  # (B, 1, S, T)
    mask[0, 0, 3] = False  # query 3 of row 0 may see no key of k0
    q = torch.randn(B, N, S, E, dtype=dtype, requires_grad=True)
    k0, k_chain = (torch.randn(*shape, E, dtype=dtype, requires_grad=True) for shape in ((B, N, T), (B, N, S, J)))
    v0, v_chain = (torch.randn(*shape, value_width, dtype=dtype, requires_grad=True)
                   for shape in ((B, N, T), (B, N, S, J)))
    inputs = (q, k0, v0, k_chain, v_chain)
    got = chain_attention(q, k0, v0, model.attention_bias(mask, dtype), k_chain, v_chain, 0.4)  # (B, N, S, Ev)
    want = dense_chain_attention(q, k0, v0, mask, k_chain, v_chain, 0.4)  # (B, N, S, Ev)
    assert torch.isfinite(got).all()
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, want, **tolerance)
    probe = torch.randn_like(want)
    names = ("q", "k0", "v0", "k_chain", "v_chain")
    for name, a, b in zip(names, torch.autograd.grad((got * probe).sum(), inputs),
                          torch.autograd.grad((want * probe).sum(), inputs), strict=True):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, **tolerance, msg=lambda message: f"d{name}: {message}")
