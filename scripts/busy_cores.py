"""Keeps every core of this machine busy for a while: a second load to run timing-sensitive tests under.

    python scripts/busy_cores.py --seconds 900 &
    .venv/bin/python -m pytest tests/test_long_capture.py

Each worker process spins a pure-Python loop (no memory, no I/O) at normal priority, so the scheduler
shares the cores between it and whatever else runs; all of them stop by themselves after --seconds, or
at once on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import time


def spin(until_s: float) -> None:
    count = 0
    while time.monotonic() < until_s:
        for _ in range(100_000):
            count += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="worker processes (default: every core)")
    parser.add_argument("--seconds", type=float, default=600.0, help="how long they spin (default: 600)")
    args = parser.parse_args()
    if args.cores < 1 or not 0 < args.seconds <= 24 * 3600:
        parser.error("--cores must be >= 1 and --seconds in (0, 86400]")
    until_s = time.monotonic() + args.seconds
    workers = [multiprocessing.Process(target=spin, args=(until_s,), daemon=True) for _ in range(args.cores)]
    for worker in workers:
        worker.start()

    def stop(*_: object) -> None:
        for worker in workers:
            worker.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"busy_cores: {args.cores} workers for {args.seconds:g} s (pid {os.getpid()})", flush=True)
    for worker in workers:
        worker.join()


if __name__ == "__main__":
    main()
