"""scripts/bench_scheduler_hooks.py drives the plugin's hooks as SGLang calls them: run small so it cannot rot."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def load_bench():
    path = Path(__file__).parents[1] / "scripts" / "bench_scheduler_hooks.py"
    spec = importlib.util.spec_from_file_location("bench_scheduler_hooks", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_scheduler_hooks_benchmark_runs_and_every_record_is_whole() -> None:
    bench = load_bench()
    around, own, calls = bench.run(batch=4, captured=1, hidden=16, generations=2, steps=3, accepted=2, cold=False)
    # run() itself checks that each captured request's record came out whole (every row of its tokens)
    assert around > 0 and own >= 0
    assert {kind: len(times) for kind, times in calls.items()} == {
        "prefill forward": 2, "prefill processed": 2, "verify forward": 6, "verify processed": 4,
        "verify processed, finishing": 2}


def test_its_sender_side_joins_and_encodes_the_records_it_made() -> None:
    bench = load_bench()
    records: list = []
    bench.run(batch=4, captured=2, hidden=16, generations=2, steps=3, accepted=2, cold=False, records=records)
    join_us, frames_us = bench.sender_side(records, 16, cold=False)
    assert join_us > 0 and frames_us > 0
    # 2 captured requests a generation; each record: the prompt, the prefill's token and 3 steps of 3 tokens, a state
    # for every token but the last
    assert [record.state_arrays()[0].shape for record in records] == [(bench.PROMPT_LEN + 1 + 9 - 1, 3 * 16)] * 4


def test_its_floor_leaves_the_verify_steps_work_out_and_counts_each_kind_of_call() -> None:
    bench = load_bench()
    own: dict[str, int] = {}
    _, _, calls = bench.run(batch=4, captured=2, hidden=16, generations=2, steps=3, accepted=2, cold=False,
                            floor=True, own=own)  # run() checks that no record came out (their steps' rows were not kept)
    assert len(calls["verify forward"]) == 6 and set(own) == set(calls)
    with_work: dict[str, int] = {}
    records: list = []
    bench.run(batch=4, captured=2, hidden=16, generations=2, steps=3, accepted=2, cold=False, own=with_work,
              records=records)
    assert len(records) == 4 and set(with_work) == set(calls)


def test_its_draftless_decode_steps_make_whole_records() -> None:
    bench = load_bench()
    records: list = []
    _, _, calls = bench.run(batch=4, captured=3, hidden=16, generations=2, steps=5, accepted=2, cold=False,
                            records=records, draftless=True)
    assert {kind: len(times) for kind, times in calls.items()} == {
        "prefill forward": 2, "prefill processed": 2, "decode forward": 10, "decode processed": 8,
        "decode processed, finishing": 2}
    # each record: the prompt, the prefill's token and 5 decode steps' tokens, a state for every token but the last
    assert [record.state_arrays()[0].shape for record in records] == [(bench.PROMPT_LEN + 1 + 5 - 1, 3 * 16)] * 6
