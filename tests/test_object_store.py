"""Shards on object storage, against a real S3 API (moto's server, a child process on loopback).

The collector uploads sealed shards under its id, checks them and removes them here; while the bucket
does not answer, shards stay here and go up later; after a SIGKILL mid-upload a restart uploads what is
left; a partial or altered object is refused by readers and replaced by the collector. Nothing
acknowledged is lost and no record is stored twice. `shards verify`, `vocab` and `train` read s3://
prefixes through a bounded cache, each rank fetching only its own records.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path, PurePosixPath

import pytest

import capture_format as cf
from capture_format.object_store import RecordCache, parse_location, s3_filesystem
from capture_format import remote_shards
from capture_format.remote_shards import RemoteShardDirectory
from capture_format.shard_index import format_index, parse_shard_file_name, shard_file_name, shard_stem
from collector_service.uploader import Uploader, pending_uploads
from eagle_tap.cli import main
from eagle_tap.testbed.s3_server import S3Server
from eagle_tap.serve.sglang_server import free_port
from test_collector_support import OCTET_STREAM, CollectorProcess, ThreadedCollector, make_frame, make_record

sys.path.insert(0, str(Path(__file__).parent))
import trainer_data  # noqa: E402


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One S3 server for the module; its endpoint and credentials are in os.environ, as a user would set them."""
    server = S3Server(log_path=tmp_path_factory.mktemp("s3") / "moto.log").start()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in server.environment().items():
            patch.setenv(name, value)
        patch.setenv("EAGLE_TAP_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield server
    server.stop()


def new_bucket(s3: S3Server, name: str) -> str:
    s3.create_bucket(name)
    return name


def objects_under(url: str) -> dict[str, bytes]:
    """Every object directly under url, by name."""
    location = parse_location(url)
    fs = s3_filesystem()
    names = [path for path in fs.ls(location.path(), detail=False, refresh=True)]
    return {path.rsplit("/", 1)[-1]: fs.cat_file(path) for path in names}


def record_ids_in(url: str) -> Counter[str]:
    """Record ids over every index object under url (each id once means: stored once)."""
    ids: Counter[str] = Counter()
    for name, data in objects_under(url).items():
        if name.endswith(".index.json"):
            ids.update(row["record_id"] for row in json.loads(data)["records"])
    return ids


def wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def local_shards(data_dir: Path) -> list[str]:
    return sorted(name for name in os.listdir(data_dir) if parse_shard_file_name(name) is not None)


# --- names, cache -------------------------------------------------------------------------------

def test_shard_names_with_and_without_a_collector_id() -> None:
    assert shard_file_name(7, ".etap") == "shard-000007.etap"
    assert shard_file_name(7, ".etap", "c0ffee") == "shard-c0ffee-000007.etap"
    assert parse_shard_file_name("shard-c0ffee-000007.index.json") == (7, ".index.json")
    assert parse_shard_file_name("shard-000007.etap.open") == (7, ".etap.open")
    assert shard_stem("shard-000123-000007.etap") == "shard-000123-000007"  # an all-digit id still parses
    assert parse_shard_file_name("shard-C0FFEE-000007.etap") is None
    for bad in ("", "_x", "has-dash", "UPPER", "x" * 33):
        with pytest.raises(ValueError, match="collector id"):
            shard_file_name(1, ".etap", bad)


def test_capture_format_loads_no_object_store_client_until_one_is_used() -> None:
    code = ("import sys, capture_format, capture_format.remote_shards, trainer.data\n"
            "print(sorted(n for n in sys.modules if n.split('.')[0] in ('fsspec', 's3fs', 'botocore', 'boto3')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_the_record_cache_stays_bounded_and_evicts_least_recently_used(tmp_path: Path) -> None:
    cache = RecordCache(tmp_path, max_bytes=3000)
    for name in "abc":
        cache.put(name + ".frame", bytes(1000))
        time.sleep(0.01)  # distinct mtimes: use order survives a rescan
    assert cache.get("a.frame") is not None  # a is now the most recently used
    cache.put("d.frame", bytes(1000))
    assert cache.get("b.frame") is None and cache.get("a.frame") is not None
    assert sorted(os.listdir(tmp_path)) == ["a.frame", "c.frame", "d.frame"] and cache.num_bytes == 3000
    assert RecordCache(tmp_path, max_bytes=3000).num_bytes == 3000  # a new process sees what is there


# --- the collector ------------------------------------------------------------------------------

def test_collector_uploads_checks_and_removes_local_copies_and_still_dedupes(s3: S3Server, tmp_path: Path) -> None:
    url = f"s3://{new_bucket(s3, 'uploads')}/captures"
    settings = dict(data_dir=tmp_path / "data", upload_to=url, collector_id="ca", seal_after_bytes=40_000,
                    upload_retry_initial_s=0.1)
    frames = {f"rec-{index:02d}": make_frame(f"rec-{index:02d}", num_tokens=24, hidden_size=128) for index in range(9)}
    with ThreadedCollector(**settings) as collector:
        for frame in frames.values():
            assert collector.post(frame).status_code == 201
        wait_for(lambda: collector.stats()["upload"]["num_uploaded"] == collector.stats()["num_sealed_shards"] >= 3,
                 "the sealed shards to be uploaded")
    # Stopping sealed the last shard and drained its upload.
    objects = objects_under(url)
    assert all(name.startswith("shard-ca-") for name in objects) and len(objects) % 2 == 0
    index = json.loads(objects["shard-ca-000001.index.json"])
    assert index["shard"] == "shard-ca-000001.etap" and len(objects["shard-ca-000001.etap"]) == index["shard_nbytes"]
    assert record_ids_in(url) == Counter(list(frames))
    assert local_shards(tmp_path / "data") == [] and len(os.listdir(tmp_path / "data" / "uploaded")) == len(objects) // 2

    with ThreadedCollector(**settings) as collector:  # the ids of uploaded shards survive the restart
        assert collector.stats()["num_records"] == len(frames)
        again = collector.post(frames["rec-03"])
        assert again.status_code == 200 and again.json()["status"] == "duplicate"
        assert collector.post(make_frame("rec-new", num_tokens=24, hidden_size=128)).status_code == 201
    assert "shard-ca-000001.etap" in objects_under(url)  # numbers are never reused: nothing was overwritten
    assert record_ids_in(url) == Counter([*frames, "rec-new"])


def test_a_record_captured_in_parts_is_uploaded_with_its_parts_and_read_back_whole(s3: S3Server, tmp_path: Path) -> None:
    from test_capture_parts import bf16_values, part_frames

    url = f"s3://{new_bucket(s3, 'parts')}/captures"
    parts, closing = part_frames("long-remote", 60, 10)  # five parts and the record
    with ThreadedCollector(data_dir=tmp_path / "data", upload_to=url, collector_id="pa", seal_after_bytes=4_000,
                           upload_retry_initial_s=0.1) as collector:
        for frame in parts:
            assert collector.post(frame).status_code == 201
        assert collector.stats()["num_records"] == 0  # kept apart until the record closes them
        assert collector.post(closing).status_code == 201
        assert collector.stats()["num_records"] == 6 and collector.stats()["parts"]["captures_closed"] == 1
    assert not any((tmp_path / "data" / "parts").iterdir())
    with cf.open_shard_directory(url) as shards:
        assert len(shards.shards) >= 2  # the parts lie in more than one shard object
        (entry,) = shards.iter_index()
        record = shards.read_record(entry)
        window = shards.read_window(entry, 25, 45)
    assert record.token_ids.tolist() == list(range(2000, 2060))
    assert bf16_values(record.final)[:, 0].tolist() == list(range(60))
    assert bf16_values(window.final)[:, 0].tolist() == list(range(25, 45))


def test_an_unreachable_bucket_keeps_shards_local_until_it_answers(s3: S3Server, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    late = S3Server(port=free_port(), log_path=tmp_path / "late-moto.log")  # nothing listens there yet
    monkeypatch.setenv("EAGLE_TAP_S3_ENDPOINT_URL", late.endpoint_url)
    url = "s3://late/p"
    ids = [f"late-{index:02d}" for index in range(8)]
    with ThreadedCollector(data_dir=tmp_path / "data", upload_to=url, seal_after_bytes=40_000,
                           upload_retry_initial_s=0.05, upload_retry_max_s=0.5) as collector:
        for record_id in ids:
            assert collector.post(make_frame(record_id, num_tokens=24, hidden_size=128)).status_code == 201
        wait_for(lambda: collector.stats()["upload"]["num_failed_attempts"] >= 2, "uploads to fail")
        stats = collector.stats()
        assert stats["upload"]["num_uploaded"] == 0 and stats["upload"]["last_error"]
        metrics = collector.client.get("/metrics").text
        assert f"eagle_tap_collector_upload_pending_shards {float(stats['num_sealed_shards'])}" in metrics
        assert len(pending_uploads(tmp_path / "data")) == stats["num_sealed_shards"] >= 2  # all still here
        with late:
            late.create_bucket("late")
            wait_for(lambda: collector.stats()["upload"]["num_pending"] == 0, "the uploads once the bucket answers")
            collector.stop()  # seals and uploads the last shard
            assert record_ids_in(url) == Counter(ids)  # every acknowledged record, each once
            assert main(["shards", "verify", url]) == 0
    assert local_shards(tmp_path / "data") == []


def test_sigkill_mid_upload_then_restart_uploads_everything_once(s3: S3Server, tmp_path: Path) -> None:
    url = f"s3://{new_bucket(s3, 'killed')}/p"
    data_dir = tmp_path / "data"
    flags = ("--upload-to", url, "--collector-id", "k1", "--seal-after-bytes", "40000")
    collector = CollectorProcess(data_dir, *flags)
    acknowledged = []
    for index in range(60):
        response = collector.client.post("/v1/records", headers=OCTET_STREAM,
                                         content=make_frame(f"k-{index:02d}", num_tokens=24, hidden_size=128))
        assert response.status_code == 201
        acknowledged.append(f"k-{index:02d}")
    fs = s3_filesystem()
    wait_for(lambda: any(path.endswith(".index.json") for path in fs.ls("killed/p", refresh=True)),
             "the first upload", timeout_s=60)
    for index in range(60, 80):  # more shards sealed behind the uploads under way, so some are surely pending
        response = collector.client.post("/v1/records", headers=OCTET_STREAM,
                                         content=make_frame(f"k-{index:02d}", num_tokens=24, hidden_size=128))
        assert response.status_code == 201
        acknowledged.append(f"k-{index:02d}")
    collector.kill()  # SIGKILL while the uploader works through the sealed shards
    uploaded_before = record_ids_in(url)
    assert uploaded_before and pending_uploads(data_dir), "the kill missed the uploads"

    collector = CollectorProcess(data_dir, *flags)
    try:
        wait_for(lambda: collector.client.get("/v1/stats").json()["upload"]["num_pending"] == 0, "the rest to upload")
    finally:
        collector.stop()  # SIGTERM: seals the open shard and drains its upload
    assert record_ids_in(url) == Counter(acknowledged)
    assert main(["shards", "verify", url]) == 0
    assert local_shards(data_dir) == []


def test_partial_or_altered_objects_are_refused_by_readers_and_replaced(s3: S3Server, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    url = f"s3://{new_bucket(s3, 'partial')}/p"
    data_dir = tmp_path / "data"
    records = [make_record(f"p-{index}", num_tokens=24, hidden_size=128) for index in range(6)]
    indexes = cf.write_shards(records, data_dir, records_per_shard=2)
    originals = {index.shard_path.name: index.shard_path.read_bytes() for index in indexes}
    fs = s3_filesystem()
    for index, damage in zip(indexes[:2], ("truncate", "flip")):  # what a dead or foreign writer could leave
        name = shard_file_name(parse_shard_file_name(index.shard_path.name)[0], ".etap", "pd")
        data = bytearray(originals[index.shard_path.name])
        if damage == "truncate":
            del data[len(data) // 2:]
        else:
            data[-10] ^= 0x40  # inside the last frame's payload: same size, other bytes
        fs.pipe_file(f"partial/p/{name}", bytes(data))
        fs.pipe_file(f"partial/p/{shard_stem(name)}.index.json",
                     format_index(replace(index, shard_path=PurePosixPath(name))).encode())

    assert main(["shards", "verify", url]) == 1
    output = capsys.readouterr().out
    assert "partial or foreign object" in output and "stored bytes hash to" in output, output
    with RemoteShardDirectory(url, skip_damaged=True, cache=RecordCache(tmp_path / "cache")) as shards:
        assert [damaged.path.name for damaged in shards.damaged] == ["shard-pd-000001.etap"]
        with pytest.raises(cf.ChecksumError, match="shard-pd-000002.etap at offset"):
            shards.read_record(shards.shards[0].entries[-1])

    with ThreadedCollector(data_dir=data_dir, upload_to=url, collector_id="pd", upload_retry_initial_s=0.1) as collector:
        wait_for(lambda: collector.stats()["upload"]["num_uploaded"] == 3, "the shards to be (re)uploaded")
    assert main(["shards", "verify", url]) == 0
    objects = objects_under(url)
    for local_name, data in originals.items():
        assert objects[local_name.replace("shard-", "shard-pd-")] == data
    assert record_ids_in(url) == Counter(record.record_id for record in records)


def test_a_shard_damaged_here_is_refused_before_upload_and_named_in_stats(s3: S3Server, tmp_path: Path) -> None:
    url = f"s3://{new_bucket(s3, 'damaged-here')}/p"
    data_dir = tmp_path / "data"
    records = [make_record(f"d-{index}", num_tokens=24, hidden_size=128) for index in range(6)]
    indexes = cf.write_shards(records, data_dir, records_per_shard=2)
    damaged_path = indexes[1].shard_path
    data = bytearray(damaged_path.read_bytes())
    data[-10] ^= 0x40  # inside the last frame's payload: same size, its index still loads
    damaged_path.write_bytes(bytes(data))
    with ThreadedCollector(data_dir=data_dir, upload_to=url, collector_id="dh", upload_retry_initial_s=0.05,
                           upload_retry_max_s=0.1) as collector:
        wait_for(lambda: collector.stats()["upload"]["num_uploaded"] == 2, "the good shards to be uploaded")
        time.sleep(0.3)  # time for retries, were there any
        upload = collector.client.get("/v1/stats").json()["upload"]
    (reason,) = upload["refused"].values()
    assert list(upload["refused"]) == [damaged_path.name], upload
    assert "does not match its index" in reason and "record 'd-3'" in reason and "eagle-tap shards repair" in reason
    assert upload["num_failed_attempts"] == 0 and upload["num_pending"] == 0, upload
    assert sorted(objects_under(url)) == ["shard-dh-000001.etap", "shard-dh-000001.index.json",
                                          "shard-dh-000003.etap", "shard-dh-000003.index.json"]  # nothing of it put
    assert damaged_path.read_bytes() == bytes(data)  # left here for repair


# --- readers: verify, stats, vocab, train, ranks ----------------------------------------------------

@pytest.fixture(scope="module")
def training_bucket(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The tiny target's training and held-out shards, uploaded by the collector's uploader."""
    inputs = trainer_data.prepared_inputs()
    s3.create_bucket("training")
    urls = {}
    for key in ("train_shards", "heldout_shards"):
        data_dir = tmp_path_factory.mktemp(key)
        for path in inputs[key].iterdir():
            shutil.copy(path, data_dir / path.name)
        urls[key] = f"s3://training/{key}"
        uploader = Uploader(data_dir, parse_location(urls[key]), "tr", keep_local=True, retry_initial_s=0.1,
                            retry_max_s=1.0)
        uploader.start()
        uploader.stop(drain_s=60)
        uploader.join()
        assert uploader.num_uploaded == len(list(inputs[key].glob("*.etap"))) and not pending_uploads(data_dir)
    return urls


def test_vocab_and_stats_from_a_bucket_equal_the_local_ones(training_bucket: dict[str, str], tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    inputs = trainer_data.prepared_inputs()
    assert main(["shards", "stats", training_bucket["train_shards"]]) == 0
    remote_stats = capsys.readouterr().out
    assert main(["shards", "stats", str(inputs["train_shards"])]) == 0
    local_stats = capsys.readouterr().out
    # The same totals; only the codec lines, read from frame headers, are local-only (stats fetches no shard).
    assert [line for line in remote_stats.splitlines() if not line.startswith("codecs: not listed")] == \
        [line for line in local_stats.splitlines() if not line.startswith("codec ")]
    assert "records" in remote_stats and "codecs: not listed for an object store" in remote_stats
    for source, out in ((training_bucket["train_shards"], tmp_path / "remote"), (str(inputs["train_shards"]),
                                                                               tmp_path / "local")):
        assert main(["vocab", "--target", str(inputs["target"]), "--draft-vocab-size", "512", "--out", str(out),
                     "--shards", source]) == 0
    assert (tmp_path / "remote" / "token_frequencies.json").read_text() == \
        (tmp_path / "local" / "token_frequencies.json").read_text()
    assert (tmp_path / "remote" / "d2t.npy").read_bytes() == (tmp_path / "local" / "d2t.npy").read_bytes()


def test_training_from_a_bucket_equals_training_from_disk(training_bucket: dict[str, str], tmp_path: Path) -> None:
    from test_trainer_train import run_config
    from trainer.metrics import read_metrics

    inputs = trainer_data.prepared_inputs()
    losses = {}
    for name, shards, heldout in (("remote", training_bucket["train_shards"], training_bucket["heldout_shards"]),
                                  ("local", str(inputs["train_shards"]), str(inputs["heldout_shards"]))):
        config = run_config(tmp_path / name, shards, num_steps=3, log_every=1, data__batch_size=4,
                            data__max_length=128, objective__ttt_steps=2, eval_shards=heldout,
                            data__cache_dir=str(tmp_path / f"cache-{name}"), data__cache_max_bytes=64 << 20)
        (tmp_path / f"{name}.json").write_text(json.dumps(config))
        assert main(["train", "--config", str(tmp_path / f"{name}.json")]) == 0
        losses[name] = [line["loss"] for line in read_metrics(tmp_path / name / "metrics.jsonl", "train")]
    assert len(losses["remote"]) == 3 and losses["remote"] == losses["local"]
    assert main(["eval", "--checkpoint", str(tmp_path / "remote"), "--shards", training_bucket["heldout_shards"],
                 "--out", str(tmp_path / "eval"), "--max-length", "128"]) == 0


def test_each_rank_fetches_only_its_own_records(training_bucket: dict[str, str], tmp_path: Path) -> None:
    from trainer import data

    read, cached = [], []
    for rank in range(2):
        config = data.Config(shards=training_bucket["train_shards"], batch_size=4, max_length=256,  # a window each
                             cache_dir=str(tmp_path / f"cache-{rank}"))
        dataset = data.ShardDataset(config, rank=rank, world_size=2, num_epochs=1)
        read.append({record_id for batch in data.make_loader(dataset) for record_id in batch["record_ids"]})
        cached.append(len(os.listdir(tmp_path / f"cache-{rank}")))
    assert read[0].isdisjoint(read[1]) and len(read[0]) == len(read[1]) == 32
    assert cached == [32, 32]  # one cached frame per record read, none of the other rank's


def test_a_damaged_cached_frame_is_fetched_again(training_bucket: dict[str, str], tmp_path: Path) -> None:
    cache = RecordCache(tmp_path / "cache", max_bytes=1 << 30)
    with RemoteShardDirectory(training_bucket["heldout_shards"], cache=cache) as shards:
        entry = next(shards.iter_index())
        expected = shards.read_record(entry)
        (cached,) = list((tmp_path / "cache").iterdir())
        damaged = bytearray(cached.read_bytes())
        damaged[-5] ^= 1
        cached.write_bytes(bytes(damaged))
        again = shards.read_record(entry)
        assert shards.num_fetched_records == 2 and cache.num_hits == 1
    assert (again.aux == expected.aux).all() and (again.final == expected.final).all()


def test_a_damaged_record_is_refused_without_holding_two_copies(s3: S3Server, tmp_path: Path) -> None:
    # A damaged cached copy is dropped before the store's copy is fetched: reading costs one copy, not two
    # (plus the fetch's own), even when the store's copy is damaged too and the record is refused.
    url = f"s3://{new_bucket(s3, 'bad-record')}/p"
    (index,) = cf.write_shards([make_record("big", num_tokens=4096, hidden_size=1024)], tmp_path / "data",
                                 records_per_shard=1)
    data = bytearray(index.shard_path.read_bytes())
    data[-10] ^= 0x40  # inside the payload: same size, other bytes
    fs = s3_filesystem()
    fs.pipe_file(f"bad-record/p/{index.shard_path.name}", bytes(data))
    fs.pipe_file(f"bad-record/p/{shard_stem(index.shard_path.name)}.index.json", format_index(index).encode())
    del data
    cache = RecordCache(tmp_path / "cache", max_bytes=1 << 30)
    with RemoteShardDirectory(url, cache=cache) as shards:
        (entry,) = shards.iter_index()
        assert entry.length > 4 * remote_shards.FETCH_CHUNK_NBYTES
        cache.put(shards._key(entry), bytes(entry.length))  # a damaged cached copy (all zeros)
        tracemalloc.start()
        try:
            with pytest.raises(cf.ChecksumError, match=f"{index.shard_path.name} at offset 0"):
                shards.read_record(entry)
            _, peak_nbytes = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert shards.num_fetched_records == 1 and not list((tmp_path / "cache").iterdir())
        assert peak_nbytes < 2 * entry.length, (peak_nbytes, entry.length)
        fs.pipe_file(f"bad-record/p/{index.shard_path.name}", index.shard_path.read_bytes())  # repaired
        assert shards.read_record(entry).record_id == "big" and len(list((tmp_path / "cache").iterdir())) == 1


def test_an_oversized_index_object_is_refused_unread(s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    url = f"s3://{new_bucket(s3, 'big-index')}/p"
    indexes = cf.write_shards([make_record(f"i-{index}", num_tokens=24, hidden_size=128) for index in range(3)],
                              tmp_path / "data", records_per_shard=1)
    fs = s3_filesystem()
    for index in indexes:
        fs.pipe_file(f"big-index/p/{index.shard_path.name}", index.shard_path.read_bytes())
        fs.pipe_file(f"big-index/p/{shard_stem(index.shard_path.name)}.index.json", format_index(index).encode())
    junk_nbytes = 48 << 20
    fs.pipe_file("big-index/p/shard-000002.index.json", b"\xff" * junk_nbytes)  # not JSON, and large
    monkeypatch.setattr(remote_shards, "MAX_INDEX_NBYTES", 1 << 20)
    monkeypatch.setattr(remote_shards, "INDEX_BATCH_MAX_OBJECTS", 1)  # one index at a time: order still kept
    tracemalloc.start()
    try:
        assert main(["shards", "verify", url]) == 1
        _, peak_nbytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    output = capsys.readouterr().out
    assert f"shard-000002.index.json is {junk_nbytes:,} bytes, over the {1 << 20:,} an index may be" in output, output
    assert "shard-000001.etap: 1/1 records verified, ok" in output and "shard-000003.etap: 1/1" in output
    assert "3 sealed shards, 0 without an index; 2/2 records verified: FAILED (1 problems)" in output, output
    assert peak_nbytes < junk_nbytes // 2, peak_nbytes  # the oversized object was never fetched


# --- the benchmark ----------------------------------------------------------------------------------

def test_objstore_bench_reads_every_record_from_the_bucket_and_steps(tmp_path: Path) -> None:
    from eagle_tap.bench import objstore, trainer_pipeline
    from test_bench import _check_well_formed

    tiny = trainer_pipeline.Config(num_records=12, min_tokens=24, max_tokens=64, max_length=64, batch_size=4,
                                   loader_workers=(0,), loader_passes=1, train_steps=1, ttt_steps=2,
                                   draft_vocab_size=64, work_dir=str(tmp_path))
    result = objstore.run(objstore.Config(data=tiny))
    result["wall_s"] = 1.0  # set by run_benchmarks, which this calls around
    _check_well_formed(result)
    rows = {row["item"]: row for row in result["rows"]}
    assert rows["collector upload (put, read back, check; index last)"]["records"] == 12
    for item in ("local disk", "object store, cache cold", "object store, cache warm"):
        assert rows[f"{item}, num_workers 0"]["records"] == 12  # every record, checksums verified, none skipped
    assert set(result["summary"]["object_store_cold_over_step"]) == {"0"}
    assert os.listdir(tmp_path) == []  # the work folder and the S3 server are gone
