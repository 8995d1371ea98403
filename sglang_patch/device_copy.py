"""Copying captured rows off the device without making the scheduler's thread wait.

One call per forward copies the rows of every captured request of the batch. On CPU that is a plain
copy (`HostCopier`). On CUDA (`CudaRowCopier`), per forward:
1. on the forward's own stream, one gather (`torch.cat` of the captured row ranges) into a private
   device tensor; stream order puts it after the forward that wrote the rows and before any later
   forward, so whatever that later forward writes cannot reach the gathered rows;
2. a side stream waits for the forward stream, then copies the gathered rows with `non_blocking=True`
   into a pinned host slab from a bounded pool, and records an event;
3. the gathered tensors are `record_stream`-ed on the side stream, so the caching allocator does not
   hand their memory to a later forward before the copy has read it.
The scheduler's thread only launches work; the sender thread waits on the event (`HostRows.wait()`)
before it reads a byte. When the pool has no room the rows are dropped and counted: never a wait.

Why the source rows stay valid (read in SGLang 0.5.23's source): the AFTER hook on
`TpModelWorker.forward_batch_generation` runs on the scheduler's thread right after the forward was
launched and before the next batch is. The overlap scheduler (`Scheduler.run_batch`) calls
`forward_batch_generation` inside `with self.forward_stream_ctx`, so the hook's current stream is the
forward stream, where the next forward is queued after the hook returns; without overlap everything
runs on one stream. With CUDA graphs (`decode_cuda_graph_runner.py`, for extend
`prefill_cuda_graph_runner.py`) the aux/final outputs are views of static buffers
(`runner_utils/buffers.py`) that the next replay overwrites, on that same stream. Step 1 is queued on the current stream inside the hook, so it
runs after the forward that wrote the rows and before any replay or forward that could overwrite them.

Decode steps (generate captures) copy one row per captured request per forward, so their slabs are
small (buffers are sized in 64 KiB granules, and a free buffer more than twice the size asked is not
lent for them). A slab is shared by the requests of its forward and goes back when the last of them
is sent: a long generation beside many short ones keeps its steps' slabs, short rows included. The
pool bounds that; past it captures are dropped and counted. Giving each generate capture its own
device-side block of rows (one scatter per step, one copy per block) would remove the sharing; not
done yet.

What must hold:
- the pool never holds more than `capacity_bytes`; `try_acquire` never blocks on the device;
- a slab goes back to the pool only when every `HostRows` cut from it was released, and nothing reads
  a `HostRows` before its `wait()` returned.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import numpy as np
import torch

__all__ = [
    "CudaRowCopier", "HostBufferPool", "HostCopier", "HostRows", "PooledRowCopier", "RowCopier", "SlabLease", "cut_slab",
    "host_cat",
]


class SlabLease:
    """A pool buffer lent out, shared by the HostRows cut from it; returned when the last one releases."""

    def __init__(self, pool: HostBufferPool, buffer: torch.Tensor, num_holders: int) -> None:
        self.buffer = buffer  # (nbytes,) uint8
        self._pool = pool
        self._num_holders = num_holders
        self._lock = threading.Lock()

    def add_holder(self) -> None:
        """One more HostRows holds the slab (a held one was cut in two)."""
        with self._lock:
            assert self._num_holders > 0, "a slab was shared after it went back"
            self._num_holders += 1

    def release_one(self) -> None:
        with self._lock:
            assert self._num_holders > 0, "a slab was released more often than it was shared"
            self._num_holders -= 1
            done = self._num_holders == 0
        if done:
            self._pool.give_back(self.buffer)


class HostBufferPool:
    """Host buffers reused across forwards (pinned on CUDA: allocating pinned memory takes milliseconds)."""

    def __init__(self, capacity_bytes: int, allocate: Callable[[int], torch.Tensor],
                 granule_bytes: int = 64 << 10) -> None:
        self.capacity_bytes = capacity_bytes
        self._allocate = allocate
        self._granule_bytes = granule_bytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.allocated_bytes = 0
        """Bytes of every buffer this pool holds, lent or free."""
        self.lent_bytes = 0

    def try_acquire(self, nbytes: int, num_holders: int) -> SlabLease | None:
        """A lease on a buffer of at least nbytes, or None when the pool is full (the caller drops)."""
        with self._lock:
            # A free buffer is reused only if it is not much larger than asked: a decode step's few rows
            # must not pin a prefill-sized buffer for as long as the generation lasts.
            largest = max(2 * nbytes, self._granule_bytes)
            fitting = [buffer for buffer in self._free if nbytes <= buffer.numel() <= largest]
            if fitting:
                buffer = min(fitting, key=torch.Tensor.numel)
                self._free.remove(buffer)
            else:
                size = -(-nbytes // self._granule_bytes) * self._granule_bytes
                while self._free and self.allocated_bytes + size > self.capacity_bytes:
                    self.allocated_bytes -= self._free.pop(0).numel()  # too small for this: make room
                if self.allocated_bytes + size > self.capacity_bytes:
                    return None
                buffer = self._allocate(size)
                self.allocated_bytes += size
            self.lent_bytes += buffer.numel()
        return SlabLease(self, buffer, num_holders)

    def give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self.lent_bytes -= buffer.numel()
            self._free.append(buffer)


@dataclasses.dataclass(kw_only=True, slots=True)
class HostRows:
    """One request's rows of one forward, in host memory (maybe still being copied: `wait()` first)."""

    aux: torch.Tensor  # (n, K*H) on CPU
    final: torch.Tensor  # (n, H) on CPU
    ready: Callable[[], None] | None = None
    """Blocks until the copy into aux/final has landed; None when it already has."""
    lease: SlabLease | None = None

    @property
    def nbytes(self) -> int:
        return self.aux.nbytes + self.final.nbytes

    def wait(self) -> None:
        if self.ready is not None:
            self.ready()

    def split(self, num_rows: int) -> tuple[HostRows, HostRows]:
        """(the first num_rows rows, the rest): views of the same buffer, each holding it until released.
        This one holds nothing afterwards."""
        assert 0 < num_rows < self.aux.shape[0], "a split must leave rows on both sides"
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.add_holder()
        head = HostRows(aux=self.aux[:num_rows], final=self.final[:num_rows], ready=self.ready, lease=lease)  # (n, K*H), (n, H)
        tail = HostRows(aux=self.aux[num_rows:], final=self.final[num_rows:], ready=self.ready, lease=lease)
        return head, tail

    def release(self) -> None:
        """Hands the host buffer back; safe to call twice."""
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release_one()


RowRanges = list[tuple[int, int]]
"""[start, end) row ranges of the captured requests in a forward's output, in batch order."""


class RowCopier:
    """Copies the captured rows of one forward to host memory: one HostRows per range, or None (dropped)."""

    def copy(self, aux: torch.Tensor, final: torch.Tensor, ranges: RowRanges) -> list[HostRows] | None:
        raise NotImplementedError


_SAME_WIDTH_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def host_copy(rows: torch.Tensor) -> torch.Tensor:
    """A copy of rows in host memory. On CPU a single-threaded memcpy (through numpy): torch's own copy
    of a few hundred KB is split over its OpenMP threads, and when the forward keeps the cores busy the
    calling thread spins at the barrier for 0.05-1.6 ms per copy here, against 0.02 ms for the memcpy."""
    if rows.device.type != "cpu":
        return rows.to("cpu", copy=True)
    as_ints = rows.contiguous().view(_SAME_WIDTH_INTS[rows.element_size()])  # numpy has no bfloat16
    return torch.from_numpy(as_ints.numpy().copy()).view(rows.dtype)


def host_cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat of CPU row blocks along dim 0, done by numpy on the calling thread alone. On a thread beside
    the forward (the sender) a torch op big enough to go parallel starts a second OpenMP team whose spinning
    threads take the cores from the forward (measured: about 0.2 s of serving lost per captured generation)."""
    ints = _SAME_WIDTH_INTS[parts[0].element_size()]  # numpy has no bfloat16
    joined = np.concatenate([part.contiguous().view(ints).numpy() for part in parts])
    return torch.from_numpy(joined).view(parts[0].dtype)


class HostCopier(RowCopier):
    """The plain copy, one per request: the right thing on CPU (no device to overlap with)."""

    def copy(self, aux: torch.Tensor, final: torch.Tensor, ranges: RowRanges) -> list[HostRows]:
        return [HostRows(aux=host_copy(aux[start:end]),  # (n, K*H)
                         final=host_copy(final[start:end]))  # (n, H)
                for start, end in ranges]


def cut_slab(lease: SlabLease, ranges: RowRanges, aux_width: int, final_width: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, list[HostRows]]:
    """Lays the gathered rows out in the slab (all aux rows, then all final rows) and cuts one HostRows
    per range. Returns the slab's aux (N, K*H) and final (N, H) views, N = rows of all ranges."""
    num_rows = sum(end - start for start, end in ranges)
    itemsize = torch.empty((), dtype=dtype).element_size()
    aux_nbytes, final_nbytes = num_rows * aux_width * itemsize, num_rows * final_width * itemsize
    assert lease.buffer.numel() >= aux_nbytes + final_nbytes, "the slab is smaller than the rows it holds"
    host_aux = lease.buffer[:aux_nbytes].view(dtype).view(num_rows, aux_width)  # (N, K*H)
    host_final = lease.buffer[aux_nbytes : aux_nbytes + final_nbytes].view(dtype).view(num_rows, final_width)  # (N, H)
    rows, offset = [], 0
    for start, end in ranges:
        count = end - start
        rows.append(HostRows(aux=host_aux[offset : offset + count], final=host_final[offset : offset + count],
                             lease=lease))
        offset += count
    return host_aux, host_final, rows


def slab_nbytes(ranges: RowRanges, aux: torch.Tensor, final: torch.Tensor) -> int:
    num_rows = sum(end - start for start, end in ranges)
    return num_rows * (aux.shape[1] * aux.element_size() + final.shape[1] * final.element_size())


class PooledRowCopier(RowCopier):
    """Gather, then one copy into a slab of a bounded host pool, cut per request. Synchronous here (the
    CPU tests drive the pool, cutting and drop logic through it); `CudaRowCopier` makes the copy async."""

    def __init__(self, pool: HostBufferPool) -> None:
        self.pool = pool

    def copy(self, aux: torch.Tensor, final: torch.Tensor, ranges: RowRanges) -> list[HostRows] | None:
        assert aux.dtype == final.dtype, "aux and final share one dtype in a record"
        lease = self.pool.try_acquire(slab_nbytes(ranges, aux, final), num_holders=len(ranges))
        if lease is None:
            return None
        host_aux, host_final, rows = cut_slab(lease, ranges, aux.shape[1], final.shape[1], aux.dtype)
        try:
            # A private copy of the rows, queued behind the forward and ahead of the next one (see above).
            aux_rows = torch.cat([aux[start:end] for start, end in ranges])  # (N, K*H) on the device
            final_rows = torch.cat([final[start:end] for start, end in ranges])  # (N, H) on the device
            ready = self._to_host(aux_rows, final_rows, host_aux, host_final)
        except BaseException:
            for host_rows in rows:
                host_rows.release()
            raise
        for host_rows in rows:
            host_rows.ready = ready
        return rows

    def _to_host(self, aux_rows: torch.Tensor, final_rows: torch.Tensor, host_aux: torch.Tensor,
                 host_final: torch.Tensor) -> Callable[[], None] | None:
        """Starts copying the gathered rows into the slab; returns what waits for it (None: done)."""
        host_aux.copy_(aux_rows)
        host_final.copy_(final_rows)
        return None


class CudaRowCopier(PooledRowCopier):
    """Non-blocking copy to a pinned slab on a side stream ordered after the forward; an event to wait on."""

    def __init__(self, device: torch.device, capacity_bytes: int) -> None:
        super().__init__(HostBufferPool(
            capacity_bytes, lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)))
        self.device = device
        self._copy_stream = torch.cuda.Stream(device)

    def _to_host(self, aux_rows: torch.Tensor, final_rows: torch.Tensor, host_aux: torch.Tensor,
                 host_final: torch.Tensor) -> Callable[[], None]:
        # The device-to-host copy, off the forward stream and after the gather; nothing here waits.
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            host_aux.copy_(aux_rows, non_blocking=True)
            host_final.copy_(final_rows, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._copy_stream)
        # Keep the gathered rows' memory away from later forwards until the copy stream has read them.
        aux_rows.record_stream(self._copy_stream)
        final_rows.record_stream(self._copy_stream)
        return copied.synchronize
