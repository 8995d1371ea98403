"""scripts/gpu_check_trainer.py: runs on the CPU at a reduced size (so it cannot rot), and at full size on a GPU.

What must hold: exit 0, one finite result per window, the correctness check ran and passed, and the printed
memory budget is the parameter count of trainer.model.Eagle3Draft at the same size.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer import model

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check_trainer.py"
SMALL = dict(hidden_size=128, heads=2, kv_heads=2, head_dim=64, intermediate_size=256, vocab_size=1024,
             draft_vocab_size=256)
GIB = 2**30


def run_script(tmp_path: Path, *args: str, timeout_s: float) -> dict:
    out = tmp_path / "out.json"
    result = subprocess.run([sys.executable, str(SCRIPT), *args, "--json", str(out)], capture_output=True, text=True,
                            timeout=timeout_s, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=SCRIPT.parents[1])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip().endswith("OK")
    assert "| window | tokens/s | MFU | peak GiB | loss |" in result.stdout
    return json.loads(out.read_text())


def assert_windows_and_check(report: dict, windows: list[int]) -> None:
    assert [entry["window"] for entry in report["windows"]] == windows
    for entry in report["windows"]:
        if entry["oom"]:
            continue
        assert math.isfinite(entry["tokens_per_s"]) and entry["tokens_per_s"] > 0
        assert math.isfinite(entry["loss"]) and entry["loss"] > 0
    assert not report["windows"][0]["oom"]
    check = report["check"]
    assert check["passed"]
    assert math.isfinite(check["reference_loss_fp32_cpu"]) and math.isfinite(check["run_loss"])
    assert check["relative_difference"] <= check["tolerance"]
    assert check["gradient_cosine"] > 0.99


def test_runs_on_cpu_at_a_reduced_size_with_the_drafts_parameter_budget(tmp_path: Path) -> None:
    options = [f"--{name.replace('_', '-')}={value}" for name, value in SMALL.items()]
    report = run_script(tmp_path, "--device", "cpu", *options, "--windows", "64,128", "--steps", "1", timeout_s=120)
    assert_windows_and_check(report, [64, 128])
    assert report["check"]["tolerance"] == 1e-5  # both sides fp32 on the CPU
    assert all(entry["mfu"] is None for entry in report["windows"])  # no peak to compare a CPU against

    draft = model.Eagle3Draft(model.Config(
        hidden_size=128, target_hidden_size=128, num_aux_hidden_states=3, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64, intermediate_size=256, rms_norm_eps=1e-5, vocab_size=1024,
        draft_vocab_size=256, max_position_embeddings=262144))
    num_trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    num_frozen = 2 * 1024 * 128  # the embedding and the target lm_head, (V, H) each
    budget = report["budget"]
    assert budget["trainable_params"] == num_trainable
    assert budget["frozen_params"] == num_frozen
    assert budget["frozen_dtype"] == "float32"
    assert budget["trainable_gib"] == pytest.approx(4 * num_trainable / GIB)
    assert budget["gradient_gib"] == pytest.approx(4 * num_trainable / GIB)
    assert budget["adamw_gib"] == pytest.approx(8 * num_trainable / GIB)
    assert budget["frozen_gib"] == pytest.approx(4 * num_frozen / GIB)
    assert budget["total_fixed_gib"] == pytest.approx((16 * num_trainable + 4 * num_frozen) / GIB)


def test_the_mla_layout_runs_on_cpu_with_its_own_correctness_check(tmp_path: Path) -> None:
    options = [f"--{name.replace('_', '-')}={value}" for name, value in SMALL.items()]
    report = run_script(tmp_path, "--device", "cpu", *options, "--layout", "mla", "--windows", "64", "--steps", "1",
                        timeout_s=120)
    assert_windows_and_check(report, [64])
    draft = report["draft"]
    assert draft["layout"] == "mla" and (draft["kv_lora_rank"], draft["qk_rope_head_dim"]) == (512, 64)
    llama = run_script(tmp_path, "--device", "cpu", *options, "--windows", "64", "--steps", "1", timeout_s=120)
    # The MLA layer's projections (q_a 2H x 1536, q_b, kv_a, kv_b, o) are counted, not the Llama ones.
    assert report["budget"]["trainable_params"] != llama["budget"]["trainable_params"]
    assert report["windows"][0]["flops_per_token"] != llama["windows"][0]["flops_per_token"]


def test_the_chunked_attention_runs_for_comparison_and_passes_the_same_check(tmp_path: Path) -> None:
    options = [f"--{name.replace('_', '-')}={value}" for name, value in SMALL.items()]
    report = run_script(tmp_path, "--device", "cpu", *options, "--attention", "chunked", "--windows", "64",
                        "--steps", "1", timeout_s=120)
    assert_windows_and_check(report, [64])
    assert report["attention"] == "chunked"

@pytest.mark.gpu
def test_kimi_size_mla_draft_trains_on_the_gpu_in_bf16(tmp_path: Path) -> None:
    report = run_script(tmp_path, "--device", "cuda", "--layout", "mla", "--windows", "2048,8192", timeout_s=600)
    assert_windows_and_check(report, [2048, 8192])
    assert report["draft"]["layout"] == "mla" and report["draft"]["hidden_size"] == 7168
    for entry in report["windows"]:
        assert entry["oom"] or 0 < entry["mfu"] < 1


@pytest.mark.gpu
def test_kimi_size_trains_on_the_gpu_in_bf16(tmp_path: Path) -> None:
    report = run_script(tmp_path, "--device", "cuda", timeout_s=600)
    assert_windows_and_check(report, [2048, 4096, 8192])
    assert report["check"]["tolerance"] == 2e-2  # bf16 autocast against fp32 on the CPU
    assert report["budget"]["frozen_dtype"] == "bfloat16"
    assert report["draft"]["hidden_size"] == 7168 and report["draft"]["vocab_size"] == 163840
    for entry in report["windows"]:
        assert entry["oom"] or 0 < entry["mfu"] < 1


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check_trainer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("oom_window", "exit_code"), [(128, 0), (64, 1)])
def test_an_oom_window_is_reported_and_only_a_first_window_oom_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, oom_window: int, exit_code: int,
) -> None:
    script = load_script()
    measure = script.measure_window

    def measure_or_oom(objective, optimizer, config, args, S, device):
        if S == oom_window:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return measure(objective, optimizer, config, args, S, device)

    monkeypatch.setattr(script, "measure_window", measure_or_oom)
    monkeypatch.setattr(script, "check_correctness", lambda device, seed, layout: {  # the first test runs the real one
        "reference_loss_fp32_cpu": 1.0, "run_loss": 1.0, "relative_difference": 0.0, "tolerance": 1e-5,
        "gradient_cosine": 1.0, "passed": True})
    out = tmp_path / "out.json"
    options = [f"--{name.replace('_', '-')}={value}" for name, value in SMALL.items()]
    code = script.main(["--device", "cpu", *options, "--windows", "64,128", "--steps", "1", "--json", str(out)])
    assert code == exit_code
    report = json.loads(out.read_text())
    assert [entry["oom"] for entry in report["windows"]] == [S == oom_window for S in (64, 128)]
    assert f"| {oom_window} | OOM | | | |" in capsys.readouterr().out
