"""scripts/bench_scheduler_hooks.py drives the plugin's hooks as SGLang calls them: run small so it cannot rot."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def test_the_scheduler_hooks_benchmark_runs_and_every_record_is_whole() -> None:
    path = Path(__file__).parents[1] / "scripts" / "bench_scheduler_hooks.py"
    spec = importlib.util.spec_from_file_location("bench_scheduler_hooks", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    around, own, calls = bench.run(batch=4, captured=1, hidden=16, generations=2, steps=3, accepted=2, cold=False)
    # run() itself checks that each captured request's record came out whole (every row of its tokens)
    assert around > 0 and own >= 0
    assert {kind: len(times) for kind, times in calls.items()} == {
        "prefill forward": 2, "prefill processed": 2, "verify forward": 6, "verify processed": 4,
        "verify processed, finishing": 2}
