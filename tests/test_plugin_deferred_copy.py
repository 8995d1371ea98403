"""Copies off the scheduler's thread on CPU: `DeferredHostCopier`, the copy thread, and verify steps' rows joined
into a few blocks per capture. The records' parity on real servers is in tests/test_spec_capture.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from capture_format.tag import CaptureTag
from sglang_patch.capture import CaptureAssembler
from sglang_patch.device_copy import (
    CopyFailed,
    CopyJobs,
    DeferredHostCopier,
    ForwardRows,
    HostBufferPool,
    HostCopier,
    PooledRowCopier,
    VerifyRows,
)
from sglang_patch.stats import CaptureStats
from test_spec_capture_units import CHAIN, HIDDEN, NUM_LAYERS, SpecReq, check_rows, positions_rows, prefill, verify


def states(num_rows: int, width: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.arange(num_rows * width, dtype=torch.float32).view(num_rows, width).to(dtype)


def test_rows_of_some_requests_are_copied_on_the_copy_thread() -> None:
    aux, final = states(10, 6), states(10, 2)  # (rows, K*H), (rows, H)
    ranges = [(0, 3), (4, 5), (7, 10)]
    rows = DeferredHostCopier().copy(aux, final, ranges)
    for host_rows, (start, end) in zip(rows, ranges):
        host_rows.wait()
        assert torch.equal(host_rows.aux, aux[start:end]) and torch.equal(host_rows.final, final[start:end])
        assert host_rows.aux.untyped_storage().data_ptr() != aux.untyped_storage().data_ptr()  # a copy


def test_rows_that_are_the_whole_output_are_kept_by_reference() -> None:
    aux, final = states(10, 6), states(10, 2)
    rows = DeferredHostCopier().copy(aux, final, [(0, 4), (4, 10)])
    assert [host_rows.ready for host_rows in rows] == [None, None]
    assert rows[1].aux.data_ptr() == aux[4:].data_ptr() and rows[1].final.data_ptr() == final[4:].data_ptr()
    # A view of a larger tensor is copied: a reference would keep the rows nobody captured alive.
    whole = states(20, 6)
    copied = DeferredHostCopier().copy(whole[:10], final, [(0, 10)])[0]
    copied.wait()
    assert copied.aux.data_ptr() != whole.data_ptr() and torch.equal(copied.aux, whole[:10])


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_a_verify_steps_block_is_the_one_the_device_path_gathers(tree) -> None:
    num_draft_tokens, width, batch = (6, 4, 5) if tree else (4, 4, 5)
    aux, final = states(batch * num_draft_tokens, 12), states(batch * num_draft_tokens, 4)
    accept_index = torch.full((batch, width), -1, dtype=torch.int32)
    for i in range(batch):
        nodes = [0, 2, 5][: 1 + i % 3] if tree else list(range(1 + i % 4))
        accept_index[i, : len(nodes)] = torch.tensor(nodes) + i * num_draft_tokens
    positions = [0, 2, 3]
    deferred = DeferredHostCopier().gather_verify(aux, final, accept_index, positions, num_draft_tokens)
    plain = HostCopier().gather_verify(aux, final, accept_index, positions, num_draft_tokens)
    assert isinstance(deferred, VerifyRows) and deferred.aux is aux  # a reference, nothing copied
    for slot in range(len(positions)):
        for start, end in [(0, width), (0, 1), (1, 3), (2, 2)]:
            rows = (slot * width + start, slot * width + end)
            for deferred_rows, plain_rows in zip(deferred.arrays(*rows), plain.arrays(*rows)):
                assert (deferred_rows == plain_rows).all() and deferred_rows.shape == plain_rows.shape


def test_a_failed_copy_is_raised_where_its_rows_are_read_and_the_thread_goes_on() -> None:
    jobs = CopyJobs()

    def broken() -> None:
        raise RuntimeError("bad rows")

    with pytest.raises(CopyFailed, match="bad rows"):
        jobs.submit(broken)()
    ran = []
    jobs.submit(lambda: ran.append(1))()
    assert ran == [1]
    assert issubclass(CopyFailed, ValueError)  # the sender drops and counts a capture whose rows it cannot read


def test_jobs_handed_over_together_run_in_order_and_fail_apart() -> None:
    """`CopyJobs.submit_all`: one hand-over of several jobs (several captures' joins); each has its own waiter, and a
    job that fails fails only its own."""
    jobs, ran = CopyJobs(), []

    def broken() -> None:
        ran.append("broken")
        raise RuntimeError("bad rows")

    waits = jobs.submit_all([lambda: ran.append(1), broken, lambda: ran.append(3)])
    waits[2]()
    assert ran == [1, "broken", 3]
    waits[0]()
    with pytest.raises(CopyFailed, match="bad rows"):
        waits[1]()


def test_a_job_and_what_it_holds_are_freed_before_its_waiter_is_released() -> None:
    """A forward's tensor freed on the daemon copy thread while the interpreter shuts down takes the GIL in its
    deleter and aborts the process ("terminate called without an active exception"): a process whose last act
    is waiting for a copy must find the job's references gone by then."""
    go, box, released_when_freed = threading.Event(), {}, []

    class Held:
        def __del__(self) -> None:
            released_when_freed.append(box["wait"].__self__.is_set())

    held = Held()
    box["wait"] = CopyJobs().submit(lambda held=held: go.wait())
    del held
    go.set()
    box["wait"]()
    assert released_when_freed == [False]


def test_joined_pieces_keep_their_order_and_give_their_slabs_back() -> None:
    pool = HostBufferPool(64 << 10, lambda nbytes: torch.zeros(nbytes, dtype=torch.uint8), granule_bytes=1 << 10)
    copier = PooledRowCopier(pool)
    aux, final = states(12, 6), states(12, 2)
    first = copier.copy(aux, final, [(0, 6)])[0]
    second = copier.copy(aux, final, [(6, 12)])[0]
    first.lease.add_holder()  # two requests' rows in the first block
    [joined] = copier.join_all([[(first, 4, 6), (second, 0, 3), (first, 0, 2)]])
    joined.wait()
    assert torch.equal(joined.aux, torch.cat([aux[4:6], aux[6:9], aux[0:2]]))
    assert torch.equal(joined.final, torch.cat([final[4:6], final[6:9], final[0:2]]))
    assert pool.lent_bytes == 0


@pytest.mark.parametrize("fate", ["joined by the sender", "dropped before"])
def test_a_finished_captures_unjoined_rows_give_their_slabs_back(fate) -> None:
    """The device path (pinned slabs, `PooledRowCopier`, here on CPU): the rows a finishing capture's last steps
    kept reach the sender unjoined, each piece holding its slab; joined (`states`) or dropped (`release`, e.g. no
    room in flight), every slab goes back to the pool."""
    pool = HostBufferPool(1 << 20, lambda nbytes: torch.zeros(nbytes, dtype=torch.uint8), granule_bytes=1 << 10)
    emitted: list = []
    asm = CaptureAssembler(stats=CaptureStats(), emit=emitted.append, copier=PooledRowCopier(pool),
                           served_draft=lambda: ("d" * 32, CHAIN))
    for number in (1, 2):
        asm.selector.on_request(SimpleNamespace(rid=f"rid-{number}", sampling_params=SimpleNamespace(
            custom_params=CaptureTag(record_id=f"rec-{number}", sample_id=f"s-{number}", loss_spans=(),
                                     mode="generate").to_custom_params()), cache_salt=None, input_embeds=None,
            mm_inputs=None))
    reqs = [SpecReq(1, 5), SpecReq(2, 3)]
    prefill(asm, reqs)
    verify(asm, reqs, [2, 1])
    verify(asm, reqs, [0, 3], finish={"rid-1", "rid-2"})
    assert len(emitted) == 2 and all(len(captured.run) == 2 for captured in emitted) and pool.lent_bytes > 0
    for captured in emitted:
        if fate == "joined by the sender":
            check_rows(captured, int(captured.tag.record_id[-1]))
        captured.release()
    assert pool.lent_bytes == 0


class AtenOps(TorchDispatchMode):
    """The tensor operations run on this thread while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def deferred_assembler(emitted: list) -> CaptureAssembler:
    asm = CaptureAssembler(stats=CaptureStats(), emit=emitted.append, copier=DeferredHostCopier(),
                           served_draft=lambda: ("d" * 32, CHAIN))
    for number in range(1, 4):
        asm.selector.on_request(SimpleNamespace(rid=f"rid-{number}", sampling_params=SimpleNamespace(
            custom_params=CaptureTag(record_id=f"rec-{number}", sample_id=f"s-{number}", loss_spans=(),
                                     mode="generate").to_custom_params()), cache_salt=None, input_embeds=None,
            mm_inputs=None))
    return asm


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_a_long_generation_reaches_the_sender_in_a_few_blocks(tree) -> None:
    emitted: list = []
    asm = deferred_assembler(emitted)
    a, b = SpecReq(1, 5), SpecReq(2, 3)
    prefill(asm, [a, b])
    for step in range(150):
        verify(asm, [a, b], [step % 4, (step + 1) % 4], tree=tree, finish={"rid-1", "rid-2"} if step == 149 else set())
    assert sorted(captured.tag.record_id for captured in emitted) == ["rec-1", "rec-2"]
    for captured in emitted:
        # the prompt's rows (kept by reference: a small forward) joined with the first 63 verify steps', the next
        # 64 steps', and the last 23 steps' rows, which the sender joins
        assert len(captured.chunks) == 2 and len(captured.run) == 150 - 127
        check_rows(captured, int(captured.tag.record_id[-1]))
        assert captured.record_metadata()["served_draft"]["verify_steps"] == 150


def test_a_verify_step_runs_no_tensor_op_on_the_schedulers_thread() -> None:
    emitted: list = []
    asm = deferred_assembler(emitted)
    reqs = [SpecReq(1, 5), SpecReq(2, 3), SpecReq(3, 4)]
    prefill(asm, reqs)
    num_draft_tokens = 4
    aux, final = states(3 * num_draft_tokens, 12, torch.float32), states(3 * num_draft_tokens, 4, torch.float32)
    accept_index = torch.tensor([[0, 1, -1, -1], [4, -1, -1, -1], [8, 9, 10, 11]], dtype=torch.int32)
    with AtenOps() as verify_ops:
        asm.on_verify(reqs, aux, final, accept_index, num_draft_tokens)
    for req, count in zip(reqs, [1, 0, 3]):
        req.output_ids.extend(range(count + 1))
        req.spec_verify_ct += 1
    with AtenOps() as processed_ops:
        asm.on_verify_processed(reqs, [1, 0, 3])
    assert verify_ops.ops == [] and processed_ops.ops == []  # references and counts only
    # the prompt's rows and the step's, both pieces of their forward's outputs
    assert asm.num_partials == 3 and all(len(partial.run) == 2 for partial in asm._partials.values())


@pytest.mark.parametrize("keep_max_bytes", [DeferredHostCopier.keep_max_bytes, 1000], ids=["small", "large"])
def test_a_small_prefill_forwards_rows_are_kept_by_reference_and_a_large_ones_copied(keep_max_bytes) -> None:
    """Two of three requests captured. A prefill forward whose outputs are at most `keep_max_bytes` runs no tensor op
    on the scheduler's thread: each capture notes its rows as a piece of the forward's outputs (`ForwardRows`); a
    larger one has the captured rows copied on the copy thread (`HostRows`). The records are the same."""
    emitted: list = []
    asm = deferred_assembler(emitted)
    asm._copier.keep_max_bytes = keep_max_bytes
    reqs = [SpecReq(1, 5), SpecReq(4, 2), SpecReq(2, 3)]  # rid-4 is not captured; 10 rows of 64 bytes each
    with AtenOps() as prefill_ops:
        prefill(asm, reqs)
    small = keep_max_bytes >= 10 * 64
    for partial in asm._partials.values():
        if small:
            assert partial.chunks == [] and len(partial.run) == 1 and isinstance(partial.run[0][0], ForwardRows)
            assert partial.run_held_nbytes == 10 * 64 // 2  # the forward's outputs, shared by the two captures
        else:
            assert len(partial.chunks) == 1 and partial.run == []
    # the prefill's only tensor ops are the test's own (the prompt rows it makes: `positions_rows`, `torch.cat`),
    # and in the large case the copy's two allocations
    assert ("empty" in prefill_ops.ops) == (not small)
    verify(asm, reqs, [2, 0, 1])
    verify(asm, reqs, [1, 0, 3], finish={"rid-1", "rid-2", "rid-4"})
    assert sorted(captured.tag.record_id for captured in emitted) == ["rec-1", "rec-2"]
    for captured in emitted:
        check_rows(captured, int(captured.tag.record_id[-1]))


def test_a_finishing_capture_runs_no_tensor_op_on_the_schedulers_thread() -> None:
    """The step that finishes a capture hands its record over with the rows its last steps kept unjoined and its
    `served_draft` metadata not made yet: the sender's thread joins and makes them."""
    emitted: list = []
    asm = deferred_assembler(emitted)
    reqs = [SpecReq(1, 5), SpecReq(2, 3)]
    prefill(asm, reqs)
    hook_ops: list[str] = []  # the tensor operations of the hooks' calls (not of the test's making the outputs)
    for name in ("on_verify", "on_verify_processed", "on_finished"):
        def counted(*args, call=getattr(asm, name)) -> None:
            with AtenOps() as ops:
                call(*args)
            hook_ops.extend(ops.ops)
        setattr(asm, name, counted)
    verify(asm, reqs, [2, 1])
    verify(asm, reqs, [0, 3], finish={"rid-1", "rid-2"})
    assert hook_ops == [] and sorted(captured.tag.record_id for captured in emitted) == ["rec-1", "rec-2"]
    for captured in emitted:
        assert captured.chunks == [] and len(captured.run) == 3  # the prompt's rows, then two steps', as pieces
        check_rows(captured, int(captured.tag.record_id[-1]))  # joined here, as on the sender's thread
        assert captured.run == [] and len(captured.chunks) == 1
        accepted = "20" if captured.tag.record_id == "rec-1" else "13"
        assert captured.record_metadata()["served_draft"]["accepted_per_step"] == accepted


def decode(asm, reqs: list[SpecReq], *, finish: bool = False, ops: list[str] | None = None) -> None:
    """One draftless decode step: row i is the state of request i's newest token. ops: gets the tensor operations
    the hook ran."""
    rows = [positions_rows(req.number, [len(req.full_untruncated_fill_ids) - 1]) for req in reqs]
    aux, final = torch.cat([aux for aux, _ in rows]), torch.cat([final for _, final in rows])  # (B, K*H), (B, H)
    with AtenOps() as hook_ops:
        asm.on_decode(reqs, aux, final)
    if ops is not None:
        ops.extend(hook_ops.ops)
    for req in reqs:
        req.output_ids.append(7000 + len(req.output_ids))
        if finish:
            req.finished_reason = type("FINISH_LENGTH", (), {})()
    asm.on_finished(reqs)


def test_a_draftless_decode_step_runs_no_tensor_op_and_its_rows_reach_the_sender_in_a_few_blocks() -> None:
    """Two of three requests captured: a decode step's rows are references to the forward's outputs, noted per
    capture and joined every 64 steps, not copied per step (`RowCopier.gather_decode`)."""
    emitted: list = []
    asm = deferred_assembler(emitted)
    reqs = [SpecReq(1, 5), SpecReq(4, 2), SpecReq(2, 3)]  # rid-4 is not captured
    prefill(asm, reqs)
    decode_ops: list[str] = []
    decode(asm, reqs, ops=decode_ops)
    assert decode_ops == []
    assert asm.num_partials == 2 and all(len(partial.run) == 2 for partial in asm._partials.values())
    for step in range(1, 150):
        decode(asm, reqs, finish=step == 149)
    assert sorted(captured.tag.record_id for captured in emitted) == ["rec-1", "rec-2"]
    for captured in emitted:
        # the prompt's rows joined with the first 63 steps', the next 64 steps', and the last 23 steps' rows,
        # which the sender joins
        assert len(captured.chunks) == 2 and len(captured.run) == 150 - 127
        assert captured.num_states == len(captured.token_ids) - 1
        check_rows(captured, int(captured.tag.record_id[-1]))


def test_the_copy_threads_cpu_is_counted_per_job() -> None:
    """The copy thread's CPU is capture's too (stats `copy_cpu_ns`): each job's is handed to the counter."""
    counted: list[int] = []
    jobs = CopyJobs(count_cpu=counted.append)

    def busy() -> None:
        until = time.thread_time_ns() + 2_000_000  # 2 ms of this thread's CPU
        while time.thread_time_ns() < until:
            pass

    for wait in [jobs.submit(busy) for _ in range(3)]:
        wait()  # counted before the waiter is told
    assert len(counted) == 3 and all(2_000_000 <= cpu_ns < 200_000_000 for cpu_ns in counted)


def test_the_sender_counts_the_forwards_a_records_unjoined_rows_keep_alive(tmp_path) -> None:
    """A finished capture's unjoined pieces keep their forwards' outputs alive: the sender's in-flight bound counts
    its share of them (`CapturedSequence.inflight_nbytes`), so a record that fits by its own bytes alone can still be
    dropped for the memory it holds."""
    from sglang_patch.sender import ModelIdentity, Sender
    from sglang_patch.settings import CaptureSettings
    from sglang_patch.spool import Spool

    emitted: list = []
    asm = deferred_assembler(emitted)
    reqs = [SpecReq(1, 5), SpecReq(4, 2), SpecReq(2, 3)]  # rid-4 is not captured; 64 bytes a row
    prefill(asm, reqs)  # one forward of 10 rows, pieces of it held by 2 captures
    verify(asm, reqs, [2, 0, 1], finish={"rid-1", "rid-2", "rid-4"})  # 12 candidate rows, 2 captured requests'
    record = next(captured for captured in emitted if captured.tag.record_id == "rec-1")
    assert record.chunks == [] and len(record.run) == 2
    assert record.raw_nbytes == 4 * len(record.token_ids) + (5 + 3) * 64
    # each forward's outputs, shared by the two captures that noted rows of it: the two records count them once
    assert record.inflight_nbytes == record.raw_nbytes + (10 * 64 + 12 * 64) // 2

    config = CaptureSettings(collector_url="http://127.0.0.1:9", spool_dir=tmp_path / "spool",
                             inflight_max_bytes=record.inflight_nbytes - 1)
    stats = CaptureStats()
    model = ModelIdentity(capture_layers=(1, 2), hidden_size=4, model_fingerprint="test", state_dtype="float32",
                          codec="bf16-split")
    sender = Sender(settings=config, model=model, stats=stats, spool=Spool(tmp_path / "spool" / "dp0", 1 << 20),
                    stats_path=tmp_path / "stats.json")
    try:
        assert sender.submit(record) is False
    finally:
        sender.close(timeout_s=1.0)
    assert stats.snapshot()["dropped"] == {"inflight_budget": 1} and record.run == []  # its holds given up


def test_a_prompt_prefilled_in_many_small_forwards_keeps_no_more_of_them_alive_than_the_bound(monkeypatch) -> None:
    """Each chunk of a long prompt is a small forward kept by reference; the captured rows are joined once the
    forwards they keep alive reach `_RUN_MAX_BYTES` (as a generation's steps are), not only when a part is due."""
    import sglang_patch.capture as capture_module

    forward_rows, chunk, length = 100, 5, 40  # the other 95 rows of each forward are another request's
    row_nbytes = (NUM_LAYERS * HIDDEN + HIDDEN) * 4
    monkeypatch.setattr(capture_module, "_RUN_MAX_BYTES", 3 * forward_rows * row_nbytes)
    emitted: list = []
    asm = CaptureAssembler(stats=CaptureStats(), emit=emitted.append, copier=DeferredHostCopier())
    tag = CaptureTag(record_id="rec-1", sample_id="s-1", loss_spans=(), mode="prefill")
    ids = list(range(length))
    req = SimpleNamespace(rid="rid-1", origin_input_ids=ids, output_ids=[], full_untruncated_fill_ids=ids,
                          sampling_params=SimpleNamespace(custom_params=tag.to_custom_params()), cache_salt=None,
                          input_embeds=None, mm_inputs=None)
    other = SimpleNamespace(rid="rid-other")
    asm.selector.on_request(req)
    held = []
    for start in range(0, length, chunk):
        aux = torch.full((forward_rows, NUM_LAYERS * HIDDEN), -1.0)  # (100, K*H): the captured rows first
        final = torch.full((forward_rows, HIDDEN), -1.0)  # (100, H)
        aux[:chunk], final[:chunk] = positions_rows(1, list(range(start, start + chunk)))
        asm.on_extend([req, other], [start, 0], [chunk, forward_rows - chunk], aux, final)
        partial = asm._partials.get("rid-1")
        if partial is not None:
            held.append((len(partial.chunks), partial.run_held_nbytes // (forward_rows * row_nbytes)))
    # forwards kept alive after each chunk: 1, 2, then joined at 3 (one chunk more), ...
    assert held == [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]
    assert len(emitted) == 1 and len(emitted[0].chunks) == 2 and len(emitted[0].run) == 2
    check_rows(emitted[0], 1)


def test_captures_sharing_steps_count_a_share_of_them_and_join_together_at_the_bound(monkeypatch) -> None:
    """Three of four requests captured: each step's outputs are kept alive by the three captures' rows together, so
    each counts a third of them (what the sender counts in flight), and they count once towards `_RUN_MAX_BYTES`:
    when the outputs noted since the last join reach it, every capture's rows are joined, in one hand-over to the
    copy thread (before, each capture counted every step whole against a bound of its own, and at Kimi's width
    all of them joined every third step, each its own hand-over)."""
    import sglang_patch.capture as capture_module

    row_nbytes = (NUM_LAYERS * HIDDEN + HIDDEN) * 4
    reqs = [SpecReq(1, 5), SpecReq(4, 2), SpecReq(2, 3), SpecReq(3, 4)]  # rid-4 is not captured
    prefill_nbytes, step_nbytes = 14 * row_nbytes, 4 * 4 * row_nbytes  # the prompts' forward, a verify step's
    monkeypatch.setattr(capture_module, "_RUN_MAX_BYTES", prefill_nbytes + 3 * step_nbytes)
    emitted: list = []
    asm = deferred_assembler(emitted)
    handed_over: list[int] = []
    submit_all = asm._copier.jobs.submit_all
    monkeypatch.setattr(asm._copier.jobs, "submit_all", lambda jobs: handed_over.append(len(jobs)) or submit_all(jobs))
    prefill(asm, reqs)
    held = []
    for step in range(5):
        verify(asm, reqs, [(step + i) % 4 for i in range(4)], finish={"rid-1", "rid-2", "rid-3", "rid-4"} if step == 4
               else set())
        held.append([(len(partial.chunks), len(partial.run), partial.run_held_nbytes)
                     for partial in asm._partials.values()])
    share = -(-prefill_nbytes // 3) + -(-step_nbytes // 3)  # the prompts' forward and the first step, a third each
    assert held[0] == [(0, 2, share)] * 3
    assert held[1] == [(0, 3, share + -(-step_nbytes // 3))] * 3
    assert held[2] == [(1, 0, 0)] * 3  # the third step reached the bound: all joined, in one hand-over
    assert held[3] == [(1, 1, -(-step_nbytes // 3))] * 3
    assert handed_over == [3]
    assert asm._stats.snapshot()["runs_joined_together"] == 1 and asm._stats.snapshot()["runs_joined"] == 3
    assert sorted(captured.tag.record_id for captured in emitted) == ["rec-1", "rec-2", "rec-3"]
    for captured in emitted:
        assert len(captured.chunks) == 1 and len(captured.run) == 2  # the last two steps' rows, unjoined
        check_rows(captured, int(captured.tag.record_id[-1]))


def test_a_prefill_captures_one_piece_reaches_the_sender_as_a_view_of_the_forward() -> None:
    """A record whose rows are one piece of one small extend forward is not copied to be sent: its states are views
    of the forward's outputs (`CapturedSequence.state_arrays`); a record of several pieces is joined into new memory."""
    emitted: list = []
    asm = CaptureAssembler(stats=CaptureStats(), emit=emitted.append, copier=DeferredHostCopier())
    reqs = []
    for number, length in ((1, 5), (2, 4)):
        tag = CaptureTag(record_id=f"rec-{number}", sample_id=f"s-{number}", loss_spans=(), mode="prefill")
        ids = list(range(1000 * number, 1000 * number + length))
        reqs.append(SimpleNamespace(rid=f"rid-{number}", origin_input_ids=ids, output_ids=[],
                                    full_untruncated_fill_ids=ids, cache_salt=None, input_embeds=None, mm_inputs=None,
                                    sampling_params=SimpleNamespace(custom_params=tag.to_custom_params())))
        asm.selector.on_request(reqs[-1])
    rows = [positions_rows(1, list(range(5))), positions_rows(2, list(range(4)))]
    aux, final = torch.cat([aux for aux, _ in rows]), torch.cat([final for _, final in rows])  # (9, K*H), (9, H)
    asm.on_extend(reqs[:1], [0], [3], aux[:3], final[:3])  # rec-1's first chunk alone
    asm.on_extend(reqs, [3, 0], [2, 4], aux[3:], final[3:])  # its last 2 rows and rec-2's 4
    emitted_by = {captured.tag.record_id: captured for captured in emitted}
    one_piece, two_pieces = emitted_by["rec-2"], emitted_by["rec-1"]
    assert len(one_piece.run) == 1 and len(two_pieces.run) == 2
    for captured, number, length, view in ((one_piece, 2, 4, True), (two_pieces, 1, 5, False)):
        got_aux, got_final = captured.states()
        assert np.shares_memory(got_aux.view(torch.int16).numpy(), aux.view(torch.int16).numpy()) == view
        want_aux, want_final = positions_rows(number, list(range(length)))
        assert torch.equal(got_aux, want_aux) and torch.equal(got_final, want_final)
