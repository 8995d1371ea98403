"""Shards: sealing by size, by age and at shutdown; start-up recovery of a torn tail; `eagle-tap shards`, lossy frames."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import zlib

import numpy as np

from capture_format import (
    CaptureRecord,
    ShardDirectory,
    ShardWriter,
    bfloat16_bits_from_float32,
    encode_frame,
    inspect_frame,
    load_index,
    verify_shard,
)
from collector_service.cli import main as collector_main
from eagle_tap.cli import main as eagle_tap_main
from test_collector_support import REPO_ROOT, ThreadedCollector, make_frame


def shard_names(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith("shard-"))


def test_seal_by_size(tmp_path) -> None:
    frames = [make_frame(f"size-{index}") for index in range(7)]
    frame_nbytes = len(frames[0])
    assert all(len(frame) == frame_nbytes for frame in frames)
    with ThreadedCollector(data_dir=tmp_path, seal_after_bytes=frame_nbytes * 3 - 1) as collector:
        shards_seen = [collector.post(frame).json()["shard"] for frame in frames]
        # The frame that fills a shard is answered after the seal, so its answer names the sealed file.
        first, second, third = "shard-000001.etap", "shard-000002.etap", "shard-000003.etap"
        assert shards_seen == [f"{first}.open"] * 2 + [first] + [f"{second}.open"] * 2 + [second] + [f"{third}.open"]
        stats = collector.stats()
        assert stats["num_sealed_shards"] == 2 and stats["open_shards"] == ["shard-000003.etap.open"]
        lookup = collector.client.get("/v1/records/size-0").json()
        assert lookup["shard"] == "shard-000001.etap" and lookup["sealed"] is True
        for number in (1, 2):
            report = verify_shard(tmp_path / f"shard-00000{number}.etap")
            assert report.ok and report.num_records == 3


def test_seal_by_age_without_more_traffic(tmp_path) -> None:
    with ThreadedCollector(data_dir=tmp_path, seal_after_s=0.3) as collector:
        assert collector.post(make_frame("aged")).status_code == 201
        deadline = time.monotonic() + 10
        while collector.stats()["num_sealed_shards"] == 0:
            assert time.monotonic() < deadline, "the shard was not sealed by age"
            time.sleep(0.05)
        assert collector.stats()["open_shards"] == []
        assert shard_names(tmp_path) == ["shard-000001.etap", "shard-000001.index.json"]
        assert collector.client.get("/v1/records/aged").json()["sealed"] is True
        assert collector.post(make_frame("next")).json()["shard"] == "shard-000002.etap.open"


def test_clean_shutdown_seals_and_can_leave_the_shard_open(tmp_path) -> None:
    with ThreadedCollector(data_dir=tmp_path / "sealed") as collector:
        collector.post(make_frame("a"))
    assert shard_names(tmp_path / "sealed") == ["shard-000001.etap", "shard-000001.index.json"]

    with ThreadedCollector(data_dir=tmp_path / "open", seal_on_shutdown=False) as collector:
        collector.post(make_frame("b"))
    assert shard_names(tmp_path / "open") == ["shard-000001.etap.open"]
    with ThreadedCollector(data_dir=tmp_path / "open") as collector:
        stats = collector.stats()
        assert stats["num_records"] == 1 and stats["recovered_shards"][0]["bytes_cut"] == 0


def test_startup_recovers_a_torn_tail(tmp_path) -> None:
    frames = [make_frame(f"torn-{index}") for index in range(4)]
    writer = ShardWriter(tmp_path)
    for frame in frames[:3]:
        writer.append(frame, inspect_frame(frame))
    writer.flush()
    writer.close()
    torn = len(frames[3]) // 2
    with open(writer.path, "ab") as shard:  # a crash in the middle of the 4th frame's write
        shard.write(frames[3][:torn])

    with ThreadedCollector(data_dir=tmp_path) as collector:
        stats = collector.stats()
        assert stats["num_records"] == 3 and stats["num_sealed_shards"] == 1
        assert stats["recovered_shards"] == [{"shard": "shard-000001.etap.open", "num_records": 3, "bytes_cut": torn}]
        for index in range(3):
            assert collector.client.get(f"/v1/records/torn-{index}").json()["shard"] == "shard-000001.etap"
        assert collector.client.get("/v1/records/torn-3").status_code == 404
        assert collector.post(frames[3]).status_code == 201
        assert collector.post(frames[0]).status_code == 200
    with ShardDirectory(tmp_path) as shards:
        assert sorted(entry.record_id for entry in shards.iter_index()) == [f"torn-{index}" for index in range(4)]
        assert all(verify_shard(shard.shard_path).ok for shard in shards.shards)


def test_shards_verify_and_stats_commands(tmp_path, capsys) -> None:
    with ThreadedCollector(data_dir=tmp_path, seal_after_bytes=1) as collector:
        for index in range(3):
            collector.post(make_frame(f"cli-{index}", num_tokens=10))
    capsys.readouterr()

    assert eagle_tap_main(["shards", "verify", "--shards", str(tmp_path)]) == 0
    output = capsys.readouterr().out
    assert "3 sealed shards, 0 open; 3/3 records verified: OK" in output

    assert collector_main(["shards", "stats", "--shards", str(tmp_path)]) == 0
    output = capsys.readouterr().out
    assert "records              3" in output and "tokens               30" in output
    assert "compression ratio" in output

    shard = tmp_path / "shard-000002.etap"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x10
    shard.write_bytes(bytes(data))
    (tmp_path / "shard-000009.index.json").write_text("{}")
    assert eagle_tap_main(["shards", "verify", "--shards", str(tmp_path)]) == 1
    output = capsys.readouterr().out
    assert "shard-000002.etap: 0/1 records verified, 1 problems" in output
    assert "ChecksumError" not in output and "hash to" in output
    assert "shard-000009.index.json: index without a shard" in output
    assert "FAILED (2 problems)" in output
    assert load_index(tmp_path / "shard-000001.etap").num_records == 1


def test_cli_imports_nothing_heavy_until_a_command_runs() -> None:
    code = ("import sys, eagle_tap.cli; parser = eagle_tap.cli.build_parser(); "
            "args = parser.parse_args(['collect', '--data-dir', 'd', '--port', '0']); "
            "assert args.run.__module__ == 'collector_service.cli'; "
            "heavy = [name for name in ('fastapi', 'uvicorn', 'starlette', 'prometheus_client') "
            "if name in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})


def finite_record(record_id: str, num_tokens: int = 24) -> CaptureRecord:
    """A bf16 record of finite Gaussian states (lossy codecs refuse NaN and inf, which random bits hold)."""
    rng = np.random.default_rng(zlib.crc32(record_id.encode()))
    aux = bfloat16_bits_from_float32(rng.standard_normal((num_tokens, 2, 32), dtype=np.float32)).reshape(
        num_tokens, 2, 32)
    final = bfloat16_bits_from_float32(rng.standard_normal((num_tokens, 32), dtype=np.float32)).reshape(num_tokens, 32)
    return CaptureRecord(record_id=record_id, sample_id="sample-1", model_fingerprint="tiny-test@0",
                         capture_layers=(1, 3), hidden_size=32, dtype="bfloat16",
                         token_ids=rng.integers(0, 1000, size=num_tokens, dtype=np.int32),
                         loss_spans=((1, num_tokens),), aux=aux, final=final)


def test_the_collector_stores_lossy_frames_and_the_shard_commands_name_their_codec(tmp_path, capsys) -> None:
    data_dir = tmp_path / "data"
    codecs = ["int8-row", "e4m3-row", "bf16-channel", "bf16-split"]
    with ThreadedCollector(data_dir=data_dir, seal_after_bytes=1) as collector:
        for codec in codecs:
            response = collector.post(encode_frame(finite_record(f"rec-{codec}"), codec))
            assert response.status_code == 201, response.text
    capsys.readouterr()
    assert eagle_tap_main(["shards", "verify", "--shards", str(data_dir)]) == 0
    output = capsys.readouterr().out
    assert "4/4 records verified: OK" in output
    assert re.search(r"codec int8-row: 1 records, ratio [\d.]+, LOSSY: relative RMS error 0\.\d+%", output)
    assert re.search(r"codec e4m3-row: 1 records, ratio [\d.]+, LOSSY: relative RMS error [12]\.\d+%", output)
    assert "codec bf16-channel: 1 records" in output and "codec bf16-split: 1 records" in output
    assert eagle_tap_main(["shards", "stats", "--shards", str(data_dir)]) == 0
    assert "codec int8-row: 1 records" in capsys.readouterr().out

    recoded = tmp_path / "recoded"
    assert eagle_tap_main(["shards", "recode", "--shards", str(data_dir), "--out", str(recoded), "--codec", "int8-channel"]) == 0
    output = capsys.readouterr().out
    assert "recoded 4 records" in output and "codec int8-channel: 4 records" in output
    with ShardDirectory(recoded) as shards:
        assert sorted(entry.record_id for entry in shards.iter_index()) == sorted(f"rec-{codec}" for codec in codecs)
        assert all(verify_shard(shard.shard_path).ok for shard in shards.shards)
    assert eagle_tap_main(["shards", "recode", "--shards", str(data_dir), "--out", str(recoded), "--codec", "raw"]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_the_expansion_bound_still_applies_to_lossy_frames(tmp_path) -> None:
    frame = encode_frame(finite_record("lossy", num_tokens=64), "int8-row")
    info = inspect_frame(frame)
    assert info.raw_nbytes / len(frame) > 1.5
    with ThreadedCollector(data_dir=tmp_path, max_expansion_ratio=1.5) as collector:
        response = collector.post(frame)
        assert response.status_code == 413 and response.json()["error"] == "expands_too_much"
        assert collector.stats()["num_records"] == 0
