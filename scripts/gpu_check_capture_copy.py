"""Times and checks the capture plugin's device copy on a real GPU (plain torch; no SGLang).

For a Kimi-K2-sized prefill batch (default 16,384 tokens x 4 states x 7,168 hidden, bf16: ~0.94 GB of
rows, 16 captured requests) it measures, per forward, the time the scheduler's thread spends in the
copy with
- the plain path (`HostCopier`: one `.to("cpu")` per request, which waits for the forward and the copy),
- the async path (`CudaRowCopier`: gather, non-blocking copy into a pinned slab on a side stream),
while a simulated forward (`--forward-ms` of queued GPU work) is still running when the hook is called,
and the time until the async copy has landed (copy bandwidth). It then checks that every row landed
exactly, also when the source buffers are overwritten right after the hook returns. Prints one JSON line
per measurement and a last line `OK` (exit 0) or `FAILED: <why>` (exit 1).

    python scripts/gpu_check_capture_copy.py [--tokens 16384] [--hidden 7168] [--forwards 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sglang_patch.device_copy import CudaRowCopier, HostCopier  # noqa: E402

NUM_AUX = 3  # aux states per token; with the final state, 4 states


_cycles_per_ms: dict[torch.device, float] = {}


def busy(device: torch.device, milliseconds: float) -> None:
    """Queues about `milliseconds` of GPU work on the current stream: a forward still running."""
    if device not in _cycles_per_ms:  # calibrate the spin kernel once, with events
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # warm-up
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _cycles_per_ms[device] = 10_000_000 / start.elapsed_time(end)
    torch.cuda._sleep(int(milliseconds * _cycles_per_ms[device]))


def ranges_of(num_tokens: int, num_requests: int) -> list[tuple[int, int]]:
    size = num_tokens // num_requests
    return [(index * size, (index + 1) * size) for index in range(num_requests)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--forwards", type=int, default=8)
    parser.add_argument("--forward-ms", type=float, default=50.0, help="GPU work still queued when the hook runs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("FAILED: no CUDA device")
        return 1
    device = torch.device("cuda", torch.cuda.current_device())
    aux = torch.randn(args.tokens, NUM_AUX * args.hidden, device=device).to(torch.bfloat16)  # (T, K*H)
    final = torch.randn(args.tokens, args.hidden, device=device).to(torch.bfloat16)  # (T, H)
    rows_nbytes = aux.nbytes + final.nbytes
    ranges = ranges_of(args.tokens, args.requests)
    print(json.dumps({"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                      "tokens": args.tokens, "hidden": args.hidden, "rows_gb": round(rows_nbytes / 1e9, 3),
                      "requests": args.requests, "forward_ms": args.forward_ms}))

    plain_s = []
    for _ in range(args.forwards):
        busy(device, args.forward_ms)
        started = time.perf_counter()
        HostCopier().copy(aux, final, ranges)
        plain_s.append(time.perf_counter() - started)

    copier = CudaRowCopier(device, capacity_bytes=2 * rows_nbytes + (64 << 20))
    started = time.perf_counter()
    first = copier.copy(aux, final, ranges)  # allocates the pinned slab: once per pool buffer
    first_launch_s = time.perf_counter() - started
    for rows in first:
        rows.wait()
        rows.release()
    launch_s, landed_s = [], []
    for _ in range(args.forwards):
        torch.cuda.synchronize(device)
        busy(device, args.forward_ms)
        started = time.perf_counter()
        rows = copier.copy(aux, final, ranges)
        launch_s.append(time.perf_counter() - started)
        for host_rows in rows:
            host_rows.wait()
        landed_s.append(time.perf_counter() - started)
        for host_rows in rows:
            host_rows.release()
    print(json.dumps({
        "plain_thread_ms_per_forward": round(statistics.median(plain_s) * 1e3, 2),
        "async_thread_ms_per_forward": round(statistics.median(launch_s) * 1e3, 3),
        "async_first_forward_ms_incl_pinned_alloc": round(first_launch_s * 1e3, 1),
        "async_landed_ms_after_hook": round(statistics.median(landed_s) * 1e3, 2),
        "async_copy_gb_s_incl_forward": round(rows_nbytes / statistics.median(landed_s) / 1e9, 2),
        "thread_us_per_token_plain": round(statistics.median(plain_s) / args.tokens * 1e6, 3),
        "thread_us_per_token_async": round(statistics.median(launch_s) / args.tokens * 1e6, 4),
    }))

    # Correctness: the rows land exactly, even when the next "replay" overwrites the source at once.
    expected_aux, expected_final = aux.cpu(), final.cpu()
    busy(device, args.forward_ms)
    rows = copier.copy(aux, final, ranges)
    aux.fill_(float("nan"))
    final.fill_(float("nan"))
    failures = []
    for host_rows, (start, end) in zip(rows, ranges):
        host_rows.wait()
        if not (torch.equal(host_rows.aux, expected_aux[start:end])
                and torch.equal(host_rows.final, expected_final[start:end])):
            failures.append(f"rows {start}:{end} differ")
        host_rows.release()
    if copier.pool.lent_bytes != 0:
        failures.append(f"{copier.pool.lent_bytes} bytes of pinned slabs were not given back")
    if statistics.median(launch_s) > 0.005:
        failures.append(f"the async copy held the thread {statistics.median(launch_s) * 1e3:.2f} ms (> 5 ms)")
    print(f"FAILED: {'; '.join(failures)}" if failures else "OK")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
