"""The CUDA device-copy path: a non-blocking copy on a side stream into pinned slabs, ordered after the
forward, safe against later forwards overwriting (CUDA-graph static buffers) or reusing (the caching
allocator) the rows. Needs a CUDA GPU and plain torch; no SGLang."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch

from sglang_patch.device_copy import CudaRowCopier

pytestmark = pytest.mark.gpu

HIDDEN = 1024
NUM_AUX = 3


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def forward_outputs(device: torch.device, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    aux = torch.randn(num_rows, NUM_AUX * HIDDEN, device=device).to(torch.bfloat16)  # (rows, K*H)
    final = torch.randn(num_rows, HIDDEN, device=device).to(torch.bfloat16)  # (rows, H)
    return aux, final


_script = importlib.util.spec_from_file_location(
    "gpu_check_capture_copy", Path(__file__).resolve().parent.parent / "scripts" / "gpu_check_capture_copy.py")
gpu_check = importlib.util.module_from_spec(_script)
_script.loader.exec_module(gpu_check)
busy = gpu_check.busy  # queues GPU work on the current stream: a forward still running


def test_rows_land_in_host_memory_exactly(device) -> None:
    copier = CudaRowCopier(device, capacity_bytes=256 << 20)
    aux, final = forward_outputs(device, 300)
    ranges = [(0, 100), (120, 121), (200, 300)]
    rows = copier.copy(aux, final, ranges)
    assert rows is not None
    for host_rows, (start, end) in zip(rows, ranges):
        host_rows.wait()
        assert host_rows.aux.is_pinned() and not host_rows.aux.is_cuda
        assert torch.equal(host_rows.aux, aux[start:end].cpu()) and torch.equal(host_rows.final, final[start:end].cpu())
        host_rows.release()
    assert copier.pool.lent_bytes == 0


def test_the_hook_does_not_wait_for_the_device(device) -> None:
    copier = CudaRowCopier(device, capacity_bytes=512 << 20)
    aux, final = forward_outputs(device, 4096)
    for warm_up in copier.copy(aux, final, [(0, 4096)]):  # the pinned slab is allocated: steady state from here
        warm_up.wait()
        warm_up.release()
    busy(device, 300)  # the forward that produced the rows is still running
    started = time.perf_counter()
    rows = copier.copy(aux, final, [(0, 2048), (2048, 4096)])
    launch_s = time.perf_counter() - started
    assert launch_s < 0.05, f"copy() held the scheduler's thread {launch_s * 1e3:.1f} ms while the GPU was busy"
    for host_rows in rows:
        host_rows.wait()
    assert torch.equal(rows[1].aux, aux[2048:].cpu())


def test_later_forwards_cannot_overwrite_or_reuse_the_rows_before_they_land(device) -> None:
    copier = CudaRowCopier(device, capacity_bytes=512 << 20)
    aux, final = forward_outputs(device, 8192)
    expected_aux, expected_final = aux.cpu(), final.cpu()
    busy(device, 200)
    rows = copier.copy(aux, final, [(0, 8192)])
    # The next "replay" writes the same static buffers, and new tensors take whatever memory is free.
    aux.fill_(float("nan"))
    final.fill_(float("nan"))
    for _ in range(8):
        torch.empty(8192, NUM_AUX * HIDDEN, dtype=torch.bfloat16, device=device).fill_(float("nan"))
    rows[0].wait()
    assert torch.equal(rows[0].aux, expected_aux) and torch.equal(rows[0].final, expected_final)


def test_an_exhausted_pool_drops_without_waiting(device) -> None:
    aux, final = forward_outputs(device, 1024)
    copier = CudaRowCopier(device, capacity_bytes=(1024 * 4 * HIDDEN * 2) + (1 << 20))
    held = copier.copy(aux, final, [(0, 1024)])
    assert held is not None
    busy(device, 200)
    started = time.perf_counter()
    assert copier.copy(aux, final, [(0, 1024)]) is None
    assert time.perf_counter() - started < 0.01
    held[0].wait()
    held[0].release()
    assert copier.copy(aux, final, [(0, 1024)]) is not None
