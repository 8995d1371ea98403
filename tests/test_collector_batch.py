"""/v1/batches: several frames per POST, each acknowledged on its own; a bad frame spoils nothing else."""

from __future__ import annotations

import pytest

from capture_format import ShardDirectory
from collector_service.receive_batch import BATCH_CONTENT_TYPE, MAX_FRAMES_PER_BATCH
from sglang_patch.delivery import CollectorClient
from test_collector_support import TOKEN, ThreadedCollector, flip_bit, make_frame


@pytest.fixture
def collector(tmp_path):
    with ThreadedCollector(data_dir=tmp_path / "data") as running:
        yield running


def post_batch(collector: ThreadedCollector, frames: list[bytes]) -> list[dict]:
    response = collector.client.post("/v1/batches", content=b"".join(frames),
                                     headers={"Content-Type": BATCH_CONTENT_TYPE})
    assert response.status_code == 200, response.text
    return response.json()["results"]


def test_each_frame_of_a_batch_is_stored_and_a_resend_is_duplicate(collector: ThreadedCollector) -> None:
    frames = [make_frame(f"batch-{index}", num_tokens=4 + index) for index in range(5)]
    results = post_batch(collector, frames)
    assert [(result["record_id"], result["status"]) for result in results] == \
        [(f"batch-{index}", "stored") for index in range(5)]
    assert [result["status"] for result in post_batch(collector, frames[1:3])] == ["duplicate", "duplicate"]
    stats = collector.stats()
    assert stats["num_records"] == 5 and stats["num_duplicates"] == 2
    locations = [collector.client.get(f"/v1/records/batch-{index}").json()["offset"] for index in range(5)]
    assert locations == sorted(locations), "frames of a batch are written in body order"


def test_a_corrupt_frame_is_rejected_alone(collector: ThreadedCollector) -> None:
    good_a, good_b = make_frame("good-a"), make_frame("good-b")
    corrupt = make_frame("corrupt")
    corrupt = flip_bit(corrupt, len(corrupt) - 3)  # a payload bit: the frame still splits off cleanly
    results = post_batch(collector, [good_a, corrupt, good_b])
    assert [result["status"] for result in results] == ["stored", "rejected", "stored"]
    assert results[1]["error"] == "checksum_mismatch"
    assert collector.stats()["num_records"] == 2


def test_the_frames_of_a_batch_are_checked_a_group_at_a_time(collector: ThreadedCollector, monkeypatch) -> None:
    """One thread hop checks the frames that came together (a hop a frame cost as much CPU as a short record's
    check); a group stops near GROUP_MAX_BYTES, and a bad frame in a group is refused alone."""
    from collector_service import receive, receive_batch

    groups: list[int] = []
    check_frames = receive._check_frames

    def counted(views, max_expansion_ratio):
        groups.append(len(views))
        return check_frames(views, max_expansion_ratio)

    monkeypatch.setattr(receive, "_check_frames", counted)
    frames = [make_frame(f"group-{index}", num_tokens=4) for index in range(12)]
    frames[5] = flip_bit(frames[5], len(frames[5]) - 3)
    results = post_batch(collector, frames)
    assert [result["status"] for result in results] == ["stored"] * 5 + ["rejected"] + ["stored"] * 6
    assert groups == [12]
    groups.clear()
    monkeypatch.setattr(receive_batch, "GROUP_MAX_BYTES", 3 * len(frames[0]))
    frames = [make_frame(f"small-group-{index}", num_tokens=4) for index in range(7)]
    assert [result["status"] for result in post_batch(collector, frames)] == ["stored"] * 7
    assert groups == [3, 3, 1]
    assert collector.stats()["num_records"] == 11 + 7


def test_a_batch_post_skips_fastapis_request_handling(collector: ThreadedCollector, monkeypatch) -> None:
    """/v1/batches is a plain ASGI route: FastAPI's dependency solving and the serialisation of a returned dict cost
    the collector about 0.1 ms of a one-frame POST's 1 ms (routes_batch). The other routes are FastAPI's."""
    from fastapi import routing

    solved: list[str] = []
    solve_dependencies = routing.solve_dependencies

    async def counted(*args, **kwargs):
        solved.append(kwargs["request"].url.path)
        return await solve_dependencies(*args, **kwargs)

    monkeypatch.setattr(routing, "solve_dependencies", counted)
    assert [result["status"] for result in post_batch(collector, [make_frame("plain-route")])] == ["stored"]
    assert collector.stats()["num_records"] == 1
    assert solved == ["/v1/stats"]


def test_a_body_cut_inside_a_frame_stores_what_came_before(collector: ThreadedCollector) -> None:
    frames = [make_frame("whole-1"), make_frame("whole-2"), make_frame("cut")]
    body = b"".join(frames)[:-10]
    response = collector.client.post("/v1/batches", content=body, headers={"Content-Type": BATCH_CONTENT_TYPE})
    results = response.json()["results"]
    assert [result["status"] for result in results] == ["stored", "stored", "rejected"]
    assert results[2]["error"] == "length_mismatch"
    assert collector.store.lookup("cut") is None


def test_garbage_after_good_frames_ends_the_batch_there(collector: ThreadedCollector) -> None:
    results = post_batch(collector, [make_frame("before-garbage"), b"not a frame at all, 32 bytes or more"])
    assert [result["status"] for result in results] == ["stored", "rejected"]
    assert results[1]["error"] == "malformed_frame"


def test_wrong_content_type_and_missing_token_are_refused(collector: ThreadedCollector) -> None:
    response = collector.client.post("/v1/batches", content=make_frame("x"),
                                     headers={"Content-Type": "application/octet-stream"})
    assert response.status_code == 415 and response.json()["error"] == "unsupported_media_type"
    import httpx

    anonymous = httpx.post(f"{collector.url}/v1/batches", content=make_frame("y"),
                           headers={"Content-Type": BATCH_CONTENT_TYPE})
    assert anonymous.status_code == 401
    assert collector.stats()["num_records"] == 0


def test_frames_past_the_batch_limit_are_left_for_a_resend(tmp_path) -> None:
    with ThreadedCollector(data_dir=tmp_path / "data", durability="none") as collector:
        frames = [make_frame(f"many-{index}", num_tokens=4, hidden_size=8) for index in range(MAX_FRAMES_PER_BATCH + 3)]
        results = post_batch(collector, frames)
        assert len(results) == MAX_FRAMES_PER_BATCH
        client = CollectorClient(collector.url, token=TOKEN, deadline_s=30)
        verdicts = client.deliver(frames)
        assert [verdict.outcome for verdict in verdicts[-3:]] == ["retry"] * 3
        assert {verdict.outcome for verdict in verdicts[:-3]} == {"duplicate"}
        assert [verdict.outcome for verdict in client.deliver(frames[-3:])] == ["sent"] * 3
        client.close()


def test_the_plugin_client_sends_batches_and_reads_every_verdict(collector: ThreadedCollector) -> None:
    client = CollectorClient(collector.url, token=TOKEN, deadline_s=30)
    corrupt = make_frame("client-bad")
    frames = [make_frame("client-1"), flip_bit(corrupt, len(corrupt) - 1), make_frame("client-2")]
    assert [verdict.outcome for verdict in client.deliver(frames)] == ["sent", "rejected", "sent"]
    assert [verdict.outcome for verdict in client.deliver(frames[:1])] == ["duplicate"]
    assert client.num_posts == 2
    client.close()
    collector.stop()
    with ShardDirectory(collector.settings.data_dir) as shards:
        stored = {entry.record_id for entry in shards.iter_index()}
    assert stored == {"client-1", "client-2"}
