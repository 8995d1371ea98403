"""The host side of device copies, on CPU: the bounded pool, slabs shared by requests, waiting before
reading, and dropping (never waiting) when the pool is full. The CUDA stream/event path itself is in
test_plugin_device_copy_gpu.py."""

from __future__ import annotations

import pytest
import torch

from capture_format.tag import CaptureTag
from sglang_patch.capture import CaptureAssembler, CapturedSequence
from sglang_patch.device_copy import HostBufferPool, HostRows, PooledRowCopier, cut_slab
from sglang_patch.stats import CaptureStats

KiB = 1 << 10


class CountingAllocator:
    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, nbytes: int) -> torch.Tensor:
        self.sizes.append(nbytes)
        return torch.zeros(nbytes, dtype=torch.uint8)


def test_the_pool_reuses_buffers_and_never_exceeds_its_capacity() -> None:
    allocate = CountingAllocator()
    pool = HostBufferPool(8 * KiB, allocate, granule_bytes=KiB)
    first = pool.try_acquire(3000, num_holders=1)
    assert first is not None and first.buffer.numel() == 3 * KiB
    second = pool.try_acquire(4 * KiB, num_holders=1)
    assert second is not None and pool.allocated_bytes == 7 * KiB
    assert pool.try_acquire(2 * KiB, num_holders=1) is None, "7 KiB lent + 2 KiB > 8 KiB: drop, do not wait"
    first.release_one()
    again = pool.try_acquire(2 * KiB, num_holders=1)
    assert again is not None and again.buffer is first.buffer and len(allocate.sizes) == 2  # reused, best fit
    again.release_one()
    second.release_one()
    big = pool.try_acquire(6 * KiB, num_holders=1)  # evicts free buffers too small for it to make room
    assert big is not None and pool.allocated_bytes <= 8 * KiB and allocate.sizes[-1] == 6 * KiB
    assert pool.try_acquire(9 * KiB, num_holders=1) is None


def test_a_few_rows_never_pin_a_much_larger_free_buffer() -> None:
    allocate = CountingAllocator()
    pool = HostBufferPool(64 * KiB, allocate, granule_bytes=KiB)
    prefill = pool.try_acquire(40 * KiB, num_holders=1)
    prefill.release_one()
    decode = pool.try_acquire(500, num_holders=1)  # one decode step's rows, while a 40 KiB buffer is free
    assert decode.buffer.numel() == KiB and allocate.sizes == [40 * KiB, KiB]
    assert pool.try_acquire(30 * KiB, num_holders=1).buffer is prefill.buffer  # what the large one is for


def test_a_slab_goes_back_only_when_every_request_cut_from_it_is_released() -> None:
    pool = HostBufferPool(64 * KiB, CountingAllocator(), granule_bytes=KiB)
    lease = pool.try_acquire(1000, num_holders=3)
    assert lease is not None
    rows = cut_slab(lease, [(0, 2), (5, 6), (6, 9)], aux_width=6, final_width=3, dtype=torch.bfloat16)[2]
    rows[0].release()
    rows[2].release()
    assert pool.lent_bytes == lease.buffer.numel()
    rows[2].release()  # twice is harmless
    rows[1].release()
    assert pool.lent_bytes == 0


def test_one_gather_per_forward_lands_each_requests_rows_in_its_own_view() -> None:
    pool = HostBufferPool(64 * KiB, CountingAllocator(), granule_bytes=KiB)
    aux = torch.arange(10 * 4, dtype=torch.float32).view(10, 4).to(torch.bfloat16)  # (rows, K*H)
    final = torch.arange(10 * 2, dtype=torch.float32).view(10, 2).to(torch.bfloat16)  # (rows, H)
    ranges = [(0, 3), (3, 4), (7, 10)]
    rows = PooledRowCopier(pool).copy(aux, final, ranges)
    assert rows is not None and len(rows) == 3
    for host_rows, (start, end) in zip(rows, ranges):
        host_rows.wait()
        assert torch.equal(host_rows.aux, aux[start:end]) and torch.equal(host_rows.final, final[start:end])
        assert host_rows.lease is rows[0].lease  # one slab for the whole forward
    assert pool.allocated_bytes == KiB  # 7 rows x (4 + 2) x 2 bytes, in one granule


def test_states_wait_for_every_copy_before_reading() -> None:
    landed = []

    def landing(host: torch.Tensor, value: float):
        def ready() -> None:  # stands for an event: the bytes are only there once it returns
            host.fill_(value)
            landed.append(value)
        return ready

    chunks = []
    for value in (1.0, 2.0):
        aux, final = torch.zeros(2, 4), torch.zeros(2, 2)
        chunks.append(HostRows(aux=aux, final=final, ready=landing(aux, value)))
    captured = CapturedSequence(tag=CaptureTag(record_id="r", sample_id="s", loss_spans=()), token_ids=[1, 2, 3, 4],
                                chunks=chunks, loss_spans=(), num_states=4, metadata={})
    aux, _ = captured.states()
    assert landed == [1.0, 2.0]
    assert aux[:2].eq(1.0).all() and aux[2:].eq(2.0).all()


class Req:
    def __init__(self, rid: str, length: int) -> None:
        self.rid = rid
        self.full_untruncated_fill_ids = list(range(length))
        tag = CaptureTag(record_id=rid, sample_id=rid, loss_spans=((0, length),))

        class SamplingParams:
            custom_params = tag.to_custom_params()

        self.sampling_params = SamplingParams()
        self.cache_salt = self.input_embeds = self.mm_inputs = None


def arrive(assembler: CaptureAssembler, *reqs: Req) -> None:
    """The BEFORE hook on the scheduler's request handler selects each request before its first forward."""
    for req in reqs:
        assembler.selector.on_request(req)


@pytest.mark.parametrize("capacity_bytes", [0, 1 << 20])
def test_a_full_pool_drops_the_forwards_captures_and_keeps_nothing(capacity_bytes: int) -> None:
    pool = HostBufferPool(capacity_bytes, CountingAllocator())
    stats, emitted = CaptureStats(), []
    assembler = CaptureAssembler(stats=stats, emit=emitted.append, copier=PooledRowCopier(pool))
    reqs = [Req("a", 3), Req("b", 2)]
    arrive(assembler, *reqs)
    aux, final = torch.randn(5, 8).to(torch.bfloat16), torch.randn(5, 4).to(torch.bfloat16)
    assembler.on_extend(reqs, [0, 0], [3, 2], aux, final)
    if capacity_bytes == 0:
        assert emitted == [] and stats.snapshot()["dropped"] == {"host_buffers_full": 2}
        assert assembler.num_partials == 0
    else:
        assert [captured.tag.record_id for captured in emitted] == ["a", "b"]
        assert torch.equal(emitted[1].states()[0], aux[3:5])
        for captured in emitted:
            captured.release()
    assert pool.lent_bytes == 0


def test_a_dropped_chunked_capture_gives_its_slab_back() -> None:
    pool = HostBufferPool(1 << 20, CountingAllocator())
    stats = CaptureStats()
    assembler = CaptureAssembler(stats=stats, emit=lambda captured: None, copier=PooledRowCopier(pool))
    req = Req("chunked", 6)
    arrive(assembler, req)
    aux, final = torch.randn(3, 8).to(torch.bfloat16), torch.randn(3, 4).to(torch.bfloat16)
    assembler.on_extend([req], [0], [3], aux, final)
    assert pool.lent_bytes > 0
    assembler.on_extend([req], [4], [2], aux[:2], final[:2])  # a gap: rows 3..4 never came
    assert stats.snapshot()["dropped"] == {"gap": 1} and pool.lent_bytes == 0
