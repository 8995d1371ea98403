"""Sequence parallelism: two gloo ranks splitting a window's positions take the single-process step exactly."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from trainer import sequence_parallel, ttt
from trainer.model import Config, Eagle3Draft

NUM_RANKS = 2
S = 13
"""Positions of the test window: odd, so it is padded to 14 and split 7 + 7."""


def objective() -> ttt.Eagle3Objective:
    """A small draft (K = 3 states of width 16, hidden 32, GQA 4/2 heads) with a 3-step unroll, seeded."""
    torch.manual_seed(0)
    config = Config(hidden_size=32, target_hidden_size=16, num_aux_hidden_states=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, intermediate_size=64, rms_norm_eps=1e-6, vocab_size=64,
                    draft_vocab_size=32, max_position_embeddings=128)
    draft = Eagle3Draft(config)
    draft_ids = torch.randperm(64)[:32].sort().values  # (D,)
    with torch.no_grad():
        draft.embed_tokens.weight.normal_()
        draft.d2t.copy_(draft_ids - torch.arange(32))
        draft.t2d[draft_ids] = True
    return ttt.Eagle3Objective(draft, torch.randn(64, 16), ttt.Config(ttt_steps=3, step_weight=0.8))


def batch() -> dict:
    """Two rows: row 0 packs records of 6 and 7 rows, row 1 is one record of 13 rows learned everywhere, so
    the unroll's steps 1 and 2 at rows 5 and 6 read rows 7 and 8 of the other rank's block."""
    generator = torch.Generator().manual_seed(1)
    doc_ids = torch.tensor([[0] * 6 + [1] * 7, [0] * 13])  # (2, S)
    loss_mask = torch.rand(2, S, generator=generator) < 0.7  # (2, S)
    loss_mask[1] = True
    positions = torch.cat([torch.arange(6), torch.arange(7)]).view(1, S)  # (1, S)
    return {"aux": torch.randn(2, S, 48, generator=generator), "final": torch.randn(2, S, 16, generator=generator),
            "input_ids": torch.randint(0, 64, (2, S), generator=generator), "label_ids": torch.zeros(2, S).long(),
            "loss_mask": loss_mask, "start_mask": loss_mask.clone(),
            "position_ids": torch.cat([positions, torch.arange(S).view(1, S) + 40]), "doc_ids": doc_ids}


def step(objective: ttt.Eagle3Objective, blocks: sequence_parallel.Blocks | None) -> dict[str, torch.Tensor]:
    """One forward and backward: loss, counts and every parameter's gradient (summed over the group)."""
    window = batch() if blocks is None else sequence_parallel.pad_batch(batch(), blocks.size)
    out = objective(window, blocks)
    out["loss"].backward()
    result = {"loss": out["loss"].detach(), "correct": out["correct"], "total": out["total"],
              "step_losses": out["step_losses"]}
    if blocks is not None:
        sequence_parallel.all_reduce_gradients(objective.draft, blocks)
        result = {name: blocks.all_reduce(value) for name, value in result.items()}
    for name, parameter in objective.draft.named_parameters():
        if parameter.grad is not None:
            result[f"grad.{name}"] = parameter.grad
    return result


def run_rank(rank: int, port: int, out_dir: str) -> None:
    from safetensors.torch import save_file

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=NUM_RANKS)
    try:
        blocks = sequence_parallel.Blocks(rank=rank, size=NUM_RANKS)
        assert blocks.rows(14) == (7 * rank, 7 * rank + 7)
        result = step(objective(), blocks)
        save_file({name: value.contiguous() for name, value in result.items()}, Path(out_dir) / f"rank{rank}.safetensors")
    finally:
        torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_ranks_take_the_single_process_step_on_a_window_split_between_them(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from trainer.dense_reference import dense_objective

    torch.set_num_threads(1)
    want = step(objective(), None)
    with dense_objective():  # the same step with every score materialised (trainer/dense_reference.py)
        dense = step(objective(), None)
    assert want["total"][1:].sum() > 0 and len([name for name in want if name.startswith("grad.")]) == 13
    torch.multiprocessing.spawn(run_rank, args=(free_port(), str(tmp_path)), nprocs=NUM_RANKS)
    # Every rank holds the whole step: same loss, same summed gradients as one process, fused or dense.
    for rank, reference in [(rank, reference) for rank in range(NUM_RANKS) for reference in (want, dense)]:
        got = load_file(tmp_path / f"rank{rank}.safetensors")
        assert got.keys() == reference.keys()
        for name, value in reference.items():
            torch.testing.assert_close(got[name], value.float() if name in ("correct", "total") else value,
                                       rtol=1e-5, atol=1e-6, msg=lambda message: f"rank {rank}, {name}: {message}")


def test_a_block_split_needs_equal_blocks() -> None:
    with pytest.raises(ValueError, match="13 positions do not split into 2 equal blocks"):
        sequence_parallel.Blocks(rank=0, size=2).rows(13)
    padded = sequence_parallel.pad_batch(batch(), 2)
    assert padded["doc_ids"][:, -1].tolist() == [-1, -1] and padded["aux"].shape == (2, 14, 48)


def test_train_with_sequence_parallel_under_torchrun_logs_the_single_process_losses(tmp_path: Path) -> None:
    import json

    from test_trainer_train import run_config, train_under_torchrun
    from trainer.config_io import config_from_dict
    from trainer.metrics import read_metrics
    from trainer.config import Config as TrainConfig
    from trainer.train import train

    import trainer_data

    shards = trainer_data.prepared_inputs()["heldout_shards"]  # 16 records of 68-151 tokens: windows of 48 rows
    settings = dict(num_steps=3, log_every=1, data__batch_size=2, data__max_length=48, objective__ttt_steps=3)
    train(config_from_dict(TrainConfig, run_config(tmp_path / "one", shards, **settings)))
    config_path = tmp_path / "split.json"
    config_path.write_text(json.dumps(run_config(tmp_path / "split", shards, sequence_parallel=2, **settings)))
    train_under_torchrun(config_path, num_processes=2)
    one, split = (read_metrics(tmp_path / name / "metrics.jsonl", "train") for name in ("one", "split"))
    for a, b in zip(one, split, strict=True):
        assert (a["num_records"], a["num_loss_tokens"]) == (b["num_records"], b["num_loss_tokens"])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    digests = [json.loads((tmp_path / "split" / "final" / f"weights-digest.rank{rank}.json").read_text())
               for rank in range(2)]
    assert digests[0] == digests[1]
