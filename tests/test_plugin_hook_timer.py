"""`HookTimer`: the hooks that run every step are measured on some calls and counted for all."""

from __future__ import annotations

import time

import pytest

from sglang_patch.stats import CaptureStats, HookTimer


def run(timer: HookTimer, work, *args) -> None:
    """A hook's call as the plugin's hooks make it."""
    started = timer.start()
    work(*args)
    if started is not None:
        timer.stop(started)


def burn(cpu_us: int, calls: list[int]) -> None:
    """Work of a known CPU time on the calling thread."""
    calls.append(1)
    until = time.thread_time_ns() + cpu_us * 1000
    while time.thread_time_ns() < until:
        pass


def test_every_call_runs_once_and_is_counted() -> None:
    stats, calls = CaptureStats(), []
    timer = HookTimer(stats, every=8)
    for _ in range(1000):
        run(timer, burn, 0, calls)
    counted = stats.snapshot()["hook_calls"]
    assert len(calls) == 1000
    # Counted at each measured call; the calls after the last measured one wait for the next.
    assert counted + timer._untimed == 1000 and 1000 - 64 < counted <= 1000


def test_the_time_of_the_calls_measured_stands_for_all_of_them() -> None:
    stats, calls = CaptureStats(), []
    timer = HookTimer(stats, every=8)
    for _ in range(800):
        run(timer, burn, 40, calls)
    snapshot = stats.snapshot()
    counted = snapshot["hook_calls"]
    # Each measured call's 40 us counted eight times: an estimate of all the calls' CPU time.
    assert snapshot["hook_cpu_ns"] / 1e3 / counted == pytest.approx(40, rel=0.3)
    assert snapshot["hook_ns"] >= snapshot["hook_cpu_ns"] * 0.9


def test_the_calls_measured_follow_no_short_period() -> None:
    """A step pattern (e.g. a batch finishing every 8 or 16 steps) must not line up with the measured calls."""
    stats = CaptureStats()
    timer = HookTimer(stats, every=8)
    measured_at = []
    for step in range(4000):
        before = stats.snapshot().get("hook_calls", 0)
        run(timer, lambda: None)
        if stats.snapshot().get("hook_calls", 0) != before:
            measured_at.append(step)
    assert 400 < len(measured_at) < 600  # about one in eight
    for period in (2, 4, 8, 16, 15):
        residues = {step % period for step in measured_at}
        assert len(residues) == period  # every phase of the period has measured calls


