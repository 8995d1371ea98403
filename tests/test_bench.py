"""`eagle-tap bench`: the codec and trainer benchmarks run at a tiny size and report well-formed results,
the speculative capture benchmark pools acceptance as SGLang does and tables it per rate, the swap benchmark
swaps a draft in and back on one real CPU SGLang server (the tiny target) with checksums verified and no request
lost, the long-record benchmark captures, stores and trains on one record per length (in parts) and reports
peak memory, and the report writer's JSON round-trips and its Markdown has one table row per measured item.

No assertion on speed: benchmarks are measured, never timed tests.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from eagle_tap.bench import codecs, trainer_pipeline
from eagle_tap.bench.report import machine_info, render_markdown, run_benchmarks, write_report
from eagle_tap.cli import main

CODECS = codecs.Config(num_tokens=2048, codecs=("raw", "zstd:1", "bf16-split", "int8-row"),
                       frame_codecs=("bf16-split", "int8-row"), frame_tokens=512, repeats=1, acceptance=None)
TRAINER = trainer_pipeline.Config(num_records=12, min_tokens=24, max_tokens=64, max_length=64, batch_size=4,
                                  loader_workers=(0, 2), loader_passes=2, train_steps=1, ttt_steps=2,
                                  draft_vocab_size=64)


@pytest.fixture(scope="module")
def report() -> dict:
    return run_benchmarks(["trainer", "codecs"], configs={"codecs": CODECS, "trainer": TRAINER}, log=lambda line: None)


def _check_well_formed(result: dict) -> None:
    _check_well_formed_but_signed(result, signed=set())


def _check_well_formed_but_signed(result: dict, signed: set[str]) -> None:
    """Every column of every row is there and finite, and >= 0 unless its key is in signed."""
    assert "error" not in result, result.get("error")
    keys = [key for key, _, _ in result["columns"]]
    assert result["rows"] and all(set(keys) <= set(row) for row in result["rows"])
    for row in result["rows"]:
        for key in keys:
            value = row[key]
            assert value is None or isinstance(value, str) or (math.isfinite(value) and (key in signed or value >= 0))
    assert result["notes"] and result["wall_s"] > 0
    json.dumps(result, allow_nan=False)


def test_codec_bench_on_the_tiny_models_states(report: dict) -> None:
    result = report["benchmarks"]["codecs"]
    _check_well_formed(result)
    rows = {row["item"]: row for row in result["rows"]}
    frame_rows = [f"frames of 512 tokens, {codec} (checksums, verify)" for codec in ("bf16-split", "int8-row")]
    assert list(rows) == ["raw", "zstd:1", "bf16-split (default)", "int8-row", *frame_rows]
    assert rows["raw"]["ratio"] == 1.0 and rows["raw"]["decompress_mb_s"] is None
    # Real states compress: the high byte (sign, exponent) repeats; bf16-split beats plain zstd on them.
    assert rows["bf16-split (default)"]["ratio"] > rows["zstd:1"]["ratio"] > 1.0
    assert rows[frame_rows[0]]["ratio"] > 1.0
    # A lossy codec stores less and says what it costs: a small, nonzero error; lossless ones none.
    assert rows["int8-row"]["ratio"] > 1.8 and 0 < rows["int8-row"]["relative_error"] < 0.02
    assert rows["bf16-split (default)"]["relative_error"] == 0.0
    assert "acceptance of drafts trained on each codec: skipped" in " ".join(result["notes"])
    assert result["summary"]["raw_mb"] == pytest.approx(2048 * 4 * 128 * 2 / 1e6)
    assert result["parameters"]["source"] == "tiny-model"


def test_trainer_bench_reads_every_record_written_and_steps(report: dict) -> None:
    result = report["benchmarks"]["trainer"]
    _check_well_formed(result)
    loaders, step = result["rows"][:-1], result["rows"][-1]
    assert result["summary"]["num_records_written"] == TRAINER.num_records
    assert [row["num_workers"] for row in loaders] == [0, 2]
    for row in loaders:  # every record of every pass, with 0 or 2 workers, checksums verified, none skipped
        assert row["records"] == TRAINER.num_records * TRAINER.loader_passes
        assert row["ratio_to_step"] == pytest.approx(row["records_s"] / step["records_s"])
    assert step["records"] == TRAINER.batch_size * TRAINER.train_steps and step["ratio_to_step"] == 1.0
    assert math.isfinite(result["summary"]["final_loss"])
    assert set(result["summary"]["pipeline_over_step"]) == {"0", "2"}


def test_report_json_round_trips_and_markdown_has_a_row_per_item(report: dict, tmp_path: Path) -> None:
    json_path, markdown_path = write_report(report, tmp_path / "out")
    loaded = json.loads(json_path.read_text())
    assert loaded == json.loads(json.dumps(report))
    assert list(loaded["benchmarks"]) == ["codecs", "trainer"]  # the project's order, not the asked order
    for key in ("cpu_model", "logical_cores", "ram_gib", "os", "python", "date"):
        assert loaded["machine"][key]
    assert loaded["machine"]["versions"]["torch"]
    markdown = markdown_path.read_text()
    assert markdown == render_markdown(loaded)  # bench.md is rebuilt from bench.json alone
    sections = markdown.split("\n## ")[1:]
    assert len(sections) == 2
    for section, result in zip(sections, loaded["benchmarks"].values()):
        table = [line for line in section.splitlines() if line.startswith("|")]
        assert len(table) == 2 + len(result["rows"])  # header, separator, one line per measured item
        assert all(line.count("|") == len(result["columns"]) + 1 for line in table)
    assert "| raw | 1.000 |" in markdown


def test_a_figure_that_could_not_be_measured_is_written_as_null_and_the_rest_is_kept(report: dict,
                                                                                    tmp_path: Path) -> None:
    # spec-capture's per-token figures at 10% are NaN when no request was sampled (a short run): bench.json refused
    # them and the whole run's results were lost.
    report = json.loads(json.dumps(report))
    report["benchmarks"]["trainer"]["summary"]["unmeasured"] = {"per_token_us": [float("nan"), 1.5, float("inf")]}
    report["benchmarks"]["trainer"]["rows"][0]["records_s"] = float("nan")
    json_path, markdown_path = write_report(report, tmp_path)
    loaded = json.loads(json_path.read_text())
    assert loaded["benchmarks"]["trainer"]["summary"]["unmeasured"] == {"per_token_us": [None, 1.5, None]}
    assert loaded["benchmarks"]["trainer"]["rows"][0]["records_s"] is None
    assert loaded["benchmarks"]["codecs"] == report["benchmarks"]["codecs"]
    assert markdown_path.read_text() == render_markdown(loaded)


def test_a_failing_benchmark_is_reported_and_the_run_goes_on(tmp_path: Path) -> None:
    report = run_benchmarks(["codecs", "trainer"], configs={"codecs": codecs.Config(source="no-such-source"),
                                                            "trainer": TRAINER}, log=lambda line: None)
    assert "unknown codec bench source 'no-such-source'" in report["benchmarks"]["codecs"]["error"]
    _check_well_formed(report["benchmarks"]["trainer"])  # the benchmark after the failed one still ran
    _, markdown_path = write_report(report, tmp_path)
    assert "**failed**: ValueError: unknown codec bench source" in markdown_path.read_text()


def test_bench_command_rejects_an_unknown_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--only", "codecs,codec"])
    assert exit_info.value.code == 2
    assert "unknown benchmark 'codec'; available: codecs, collector, capture, live, trainer" in capsys.readouterr().err


def test_spec_capture_pools_acceptance_per_verify_step_and_reports_a_column_per_rate_and_the_draftless_one() -> None:
    from types import SimpleNamespace

    from eagle_tap.bench import spec_capture

    def record(steps: int, accepted: int) -> SimpleNamespace:
        return SimpleNamespace(metadata={"served_draft": {"verify_steps": steps, "accepted_drafts": accepted}})

    # Counts of two real requests (a chain of 3): 9 tokens in 5 verify steps, 23 in 20 (the last step cut by a stop).
    records = {"live-a": record(5, 3), "live-b": record(20, 3), "live-plain": SimpleNamespace(metadata={})}
    meta_infos = {"live-a": {"spec_verify_ct": 5, "spec_num_correct_drafts": 3, "completion_tokens": 9},
                  "live-b": {"spec_verify_ct": 20, "spec_num_correct_drafts": 2, "completion_tokens": 23}}
    pooled = spec_capture.pooled_acceptance(records, meta_infos, ["live-a", "live-b", "live-plain", "live-lost"])
    assert pooled["records"] == pytest.approx((6 + 25) / 25)  # (accepted drafts + verify steps) / verify steps
    assert pooled["meta_info"] == pytest.approx((5 + 25) / 25)
    assert pooled["meta_info_completion"] == pytest.approx(32 / 25)  # counts the prefill's first token too
    assert (pooled["records_agreeing"], pooled["records_compared"]) == (1, 2)  # b's drafts disagree

    config = spec_capture.Config(draft_dir="draft", rounds=5)
    entry = {"ratio": 0.97, "ratio_range": [0.91, 1.02], "cpu_ratio": 0.98, "sampled": 30, "complete": 30, "unreadable": 0, "coverage": 1.0,
             "acceptance": pooled, "captured_tokens": 2_400, "dropped": {}, "hook_errors": 0, "hook_calls": 800,
             "cpu_us_per_token": {"hook": 3.0, "sender": 20.0, "collector": 10.0, "total": 33.0}}
    measured = {"absent_tokens_s": 40.0, "absent_acceptance": {"meta_info": 2.5, "meta_info_completion": 2.6},
                "live0.1": {**entry, "rate": 0.1}, "live1": {**entry, "rate": 1.0, "dropped": {"missing_rows": 1}},
                "draftless1": {**entry, "rate": 1.0, "ratio": None, "ratio_range": None, "cpu_ratio": None, "acceptance": None,
                               "cpu_us_per_token": {"hook": 1.0, "sender": 8.0, "collector": 5.0, "total": 14.0}}}
    result = {**spec_capture.report(config, measured, "draft draft"), "wall_s": 1.0}
    _check_well_formed(result)
    assert [key for key, _, _ in result["columns"]] == ["item", "live0.1", "live1", "draftless1"]
    rows = {row["item"]: row for row in result["rows"]}
    served = rows["served throughput / no plugin (generated tok/s, median of 5 rounds; their range)"]
    assert (served["live0.1"], served["draftless1"]) == ("0.970 (0.91-1.02)", "-")  # it serves no draft
    assert rows["  sender thread (sender_cpu_ns)"]["draftless1"] == "8.00 us"
    against = rows["  sender, collector per token / the draftless server's (same requests)"]
    assert (against["live1"], against["draftless1"]) == ("2.50x, 2.00x", "-")
    assert rows["coverage: complete records / sampled requests"]["live1"] == "1.0000 (30/30, 0 unreadable)"
    assert rows["  records whose verify steps and accepted drafts equal meta_info's"]["live1"] == "1/2"
    assert rows["  forward hook calls that did work; CPU per call"]["live0.1"] == "800; 9.00 us"  # 3 us x 2,400 / 800
    assert result["notes"][-1].endswith("live1: 1 missing_rows, 0 hook errors")
    markdown = render_markdown({"mode": "full", "wall_s": 1.0, "machine": machine_info(),
                                "benchmarks": {"spec-capture": result}})
    assert "| served throughput / no plugin (generated tok/s, median of 5 rounds; their range) | 0.970 (0.91-1.02) |" in markdown


def test_codec_acceptance_trains_paired_drafts_per_codec_and_evaluates_them_on_lossless_held_out_shards(
        tmp_path) -> None:
    from trainer_data import shard_dir

    from eagle_tap.bench.codec_acceptance import AcceptanceConfig, measure_acceptance

    demo = tmp_path / "demo"
    (demo / "captures").mkdir(parents=True)
    (demo / "captures" / "train").symlink_to(shard_dir(0, 24))
    (demo / "captures" / "heldout").symlink_to(shard_dir(64, 8))
    config = AcceptanceConfig(demo_run=str(demo), codecs=("bf16-split", "int8-row"), seeds=(0, 1), train_steps=3)
    measured = measure_acceptance(config, tmp_path / "work", log=lambda line: None)
    rows = {row["codec"]: row for row in measured["rows"]}
    assert list(rows) == ["bf16-split", "int8-row"]
    assert not rows["bf16-split"]["lossy"] and rows["bf16-split"]["relative_error"] == 0.0
    assert rows["int8-row"]["lossy"] and 0 < rows["int8-row"]["relative_error"] < 0.02
    assert rows["int8-row"]["ratio"] > 1.8 > rows["bf16-split"]["ratio"]
    assert [(run["codec"], run["seed"]) for run in measured["runs"]] == [
        ("bf16-split", 0), ("bf16-split", 1), ("int8-row", 0), ("int8-row", 1)]
    for row in rows.values():
        assert 0 <= row["step0_accuracy"] <= 1 and row["acceptance_length"] >= 1
        assert row["acceptance_length"] == pytest.approx(sum(row["per_seed_acceptance_length"]) / 2)
    assert rows["bf16-split"]["acceptance_delta"] == 0 and rows["bf16-split"]["within_seed_noise"]
    # The lossy run trained on re-encoded shards; the held-out shards stayed the lossless ones.
    assert (tmp_path / "work" / "shards" / "int8-row").is_dir()
    assert measured["heldout_shards"] == str(demo / "captures" / "heldout")


@pytest.mark.sglang
def test_swap_bench_swaps_a_draft_in_and_back_idle_and_under_load() -> None:
    from eagle_tap.bench import swap

    # A -> B idle checking the target too, B -> A idle checking the draft only, A -> B loaded: one server
    config = swap.Config(hidden_sizes=(128,), num_swaps=1, gap_s=0.2)
    result = run_benchmarks(["swap"], configs={"swap": config}, log=lambda line: None)["benchmarks"]["swap"]
    _check_well_formed(result)
    assert [(row["hidden_size"], row["condition"]) for row in result["rows"]] == [
        (128, "idle+target"), (128, "idle"), (128, "load")]
    (width,) = result["summary"]["widths"]
    assert width["num_tensors"] == 13 and 1e6 < width["draft_bytes"] < 1e7  # the tiny draft's bf16 tensors
    assert 0 < width["draft_checksums_ms"] < width["checksums_ms"]  # two calls fewer, the target's among them
    for condition in swap.CONDITIONS:
        entry = width[condition]
        assert len(entry["wall_ms"]) == len(entry["paused_ms"]) == 1 and entry["verified"]
        assert 0 < entry["paused_ms"][0] < entry["wall_ms"][0]
    for row in result["rows"]:
        assert row["wall_ms"] > 0 and row["paused_ms"] > 0 and row["paused_ms_per_gb"] > 0
        assert row["verified"] == "yes (1 swap)"
    load = width["load"]
    assert load["requests_failed"] == 0 and load["requests_ok"] > 0 and load["request_s"] > 0
    assert result["summary"]["all_verified"] and result["summary"]["requests_failed"] == 0


@pytest.mark.sglang
def test_long_bench_captures_stores_and_trains_a_record_per_length_and_reports_peaks() -> None:
    from eagle_tap.bench import long

    config = long.Config.quick()  # 512 and 2,048 tokens in parts of 256: two servers, one collector, two runs
    result = run_benchmarks(["long"], configs={"long": config}, log=lambda line: None)["benchmarks"]["long"]
    _check_well_formed_but_signed(result, signed={"plugin_share_mb"})  # a difference of two peaks may be < 0
    assert [row["length"] for row in result["rows"]] == list(config.lengths)
    for row in result["rows"]:
        assert row["tokens"] == row["length"]  # prompt + generated tokens, all in the record
        assert row["parts"] == -(-row["length"] // config.part_tokens)  # the last part may be short
        assert row["stored_mb"] > 0 and row["capture_s"] > 0 and row["collector_peak_mb"] >= 0
        assert row["row_bytes"] == (3 + 1) * 128 * 2  # 3 capture layers and the final state, bf16
        assert 0 < row["most_rows_held"] <= config.part_tokens + config.chunk_tokens
        assert row["train_steps"] == config.train_steps and row["train_loss_tokens"] > 0
        assert row["train_peak_mb"] > 100  # a whole Python process with torch
    assert result["summary"]["dropped"] == {}
    assert set(result["summary"]["ratios_longest_over_reference"]) >= {"server_peak_mb", "collector_peak_mb"}


def test_trainer_scale_bench_measures_both_forms_and_projects_kimi_from_exact_counts() -> None:
    from eagle_tap.bench import trainer_scale

    config = trainer_scale.Config.quick()
    result = run_benchmarks(["trainer-scale"], configs={"trainer-scale": config},
                            log=lambda line: None)["benchmarks"]["trainer-scale"]
    _check_well_formed(result)
    measured = [row for row in result["rows"] if row["peak_mib"] is not None]
    assert [(row["item"], row["window"]) for row in measured] == [
        (f"{form}, CPU fp32", S) for form in ("dense", "fused") for S in config.windows]
    assert all(row["tokens_s"] > 0 and row["peak_mib"] > 0 for row in measured)
    assert all(row["model_mib"] > 0 for row in measured if row["item"].startswith("fused"))
    projection = result["summary"]["kimi_projection"]
    assert list(projection) == [str(S) for S in config.kimi_windows]
    peaks = [projection[str(S)]["ddp_gib"] for S in config.kimi_windows]
    assert peaks == sorted(peaks) and peaks[0] > 20  # at least the fixed weights, gradients and AdamW state
    # The model's coefficients are exact counts: the draft vocab's is the step's logits (fp32: 4 B) per TTT
    # step plus the one fp32 target distribution; under autocast the logits are bf16.
    steps = config.shape.ttt_steps
    assert result["summary"]["cpu_model"]["draft_vocab_size"] == pytest.approx(4 * steps + 4, rel=0.05)
    assert result["summary"]["gpu_model"]["draft_vocab_size"] == pytest.approx(2 * steps + 4, rel=0.05)


@pytest.mark.sglang
def test_wide_capture_bench_measures_every_stage_at_kimi_width_against_hidden_128() -> None:
    from eagle_tap.bench import wide_capture

    config = wide_capture.Config.quick()  # draftless at 100% vs no plugin, the hidden-128 server, 1 and 2 threads
    result = run_benchmarks(["wide-capture"], configs={"wide-capture": config},
                            log=lambda line: None)["benchmarks"]["wide-capture"]
    _check_well_formed(result)
    wide, narrow = result["rows"]
    assert (wide["hidden_size"], narrow["hidden_size"]) == (7168, 128) and narrow["ratio"] is None
    for row, raw in ((wide, 57_344), (narrow, 1_024)):
        assert row["captured_tokens"] > 0 and row["dropped"] == {}
        # per captured token: the states (none for a record's last token) and a 4-byte token id
        assert 0.9 * raw < row["raw_bytes"] < raw + 4
        assert 0.5 * raw < row["stored_bytes"] < row["raw_bytes"]  # bf16-split stores less than raw, not magically less
        for stage in ("hook", "sender", "collector"):
            assert row[f"{stage}_us"] > 0
            assert row[f"{stage}_cores_per_10k"] == pytest.approx(row[f"{stage}_us"] / 100)
            assert row[f"{stage}_mb_s_per_core"] == pytest.approx(row["raw_bytes"] / row[f"{stage}_us"])
    assert wide["ratio"] > 0 and wide["sender_us"] > narrow["sender_us"]  # the sender's work is per byte
    (sender_table,) = result["tables"]
    rows = sender_table["rows"]
    assert [(row["part"], row["threads"]) for row in rows] == [
        ("encode only", 1), ("Sender -> collector (fsync)", 1), ("encode only", 2), ("Sender -> collector (fsync)", 2)]
    for row in rows:
        assert row["mb_s"] > 0 and row["mb_s_per_thread"] == pytest.approx(row["mb_s"] / row["threads"])
        assert row["speedup"] == pytest.approx(1.0) if row["threads"] == 1 else row["speedup"] > 0
    for row in rows[1::2]:
        assert 0.5 * 57_344 < row["stored_bytes"] < 57_344 and row["sender_us"] > 0 and row["collector_us"] > 0
    summary = result["summary"]
    assert summary["hook_us_wide_over_narrow"] == pytest.approx(wide["hook_us"] / narrow["hook_us"])
    assert set(summary["tp8_cores"]) == {"hook", "sender", "collector"}
    assert summary["tp8_cores"]["sender"] == pytest.approx(wide["sender_us"] * 0.03)
