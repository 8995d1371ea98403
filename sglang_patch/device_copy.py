"""Copying captured rows off the device without making the scheduler's thread wait.

One call per forward copies the rows of every captured request of the batch. On CPU (`DeferredHostCopier`)
the scheduler's thread only keeps references to the forward's output tensors and hands the copy to a copy
thread (`CopyJobs`); where the captured rows are every row of those tensors it keeps the references and
copies nothing. Why that is safe, and when it is not (`HostCopier`, the plain copy, is used then), is in
`DeferredHostCopier`'s docstring. On CUDA (`CudaRowCopier`), per forward:
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

A verify forward of a replica that serves a draft hands over one block of candidate rows for all its
captured requests (`gather_verify`); the rows a capture keeps of its steps are joined into one block on the
copy thread (`join`) every few dozen steps and before the capture is sent, so the sender reads a few large
blocks per capture, not one per step.

What must hold:
- the pool never holds more than `capacity_bytes`; `try_acquire` never blocks on the device;
- a slab goes back to the pool only when every `HostRows` cut from it was released, and nothing reads
  a `HostRows` before its `wait()` returned;
- nothing on the scheduler's thread touches the captured bytes: it allocates, slices and queues; copy
  jobs run in the order they were queued, and a failed one makes `wait()` raise `CopyFailed`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

__all__ = [
    "CopyFailed", "CopyJobs", "CudaRowCopier", "DeferredHostCopier", "ForwardRows", "HostBufferPool", "HostCopier",
    "HostRows", "PooledRowCopier", "RowCopier", "RowPiece", "SlabLease", "VerifyRows", "cut_slab", "host_cat",
    "release_pieces",
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

    held_nbytes = nbytes
    """Host bytes these rows keep alive (a `VerifyRows` keeps a whole forward's outputs)."""
    share_nbytes = 0
    """What one capture noting rows of it counts as kept alive (`_KeptOutputs.share_nbytes`): nothing, these rows are
    a copy, not a forward's outputs (pinned slabs are bounded by their pool)."""

    @property
    def row_nbytes(self) -> int:
        return self.aux.shape[1] * self.aux.element_size() + self.final.shape[1] * self.final.element_size()

    def wait(self) -> None:
        if self.ready is not None:
            self.ready()

    def arrays(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows [start, end) as numpy integer views of their bytes, once copied (off the scheduler's thread)."""
        self.wait()
        return _ints(self.aux[start:end]), _ints(self.final[start:end])

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


class _KeptOutputs:
    """A forward's output tensors kept by reference (`aux` (rows, K*H), `final` (rows, H)), its captured rows pieces
    of them: nothing is copied into them, so there is nothing to wait for, and no lease."""

    __slots__ = ()
    lease = None
    aux: torch.Tensor
    final: torch.Tensor
    held_nbytes: int
    """Bytes these references keep alive: the whole of the forward's output tensors."""
    share_nbytes: int
    """What each capture noting rows of it counts of `held_nbytes` (`capture.CapturedSequence.run_held_nbytes`): the
    forward's outputs shared out among the captures of the step (set by the hook; the whole until then)."""

    @property
    def row_nbytes(self) -> int:
        return self.aux.shape[1] * self.aux.element_size() + self.final.shape[1] * self.final.element_size()

    def wait(self) -> None:
        pass


class VerifyRows(_KeptOutputs):
    """A verify forward's candidate rows of the captured requests at `positions` (batch order), kept as references
    to the forward's outputs (on CPU: `DeferredHostCopier`): request i's W rows are [i * W, (i + 1) * W), W =
    accept_index.shape[1], read off the scheduler's thread only (`arrays`: by `RowCopier.join_all` on the copy thread,
    `CapturedSequence.state_arrays` on the sender's)."""

    __slots__ = ("aux", "final", "accept_index", "positions", "num_draft_tokens", "width", "held_nbytes",
                 "share_nbytes", "_arrays")

    def __init__(self, aux: torch.Tensor, final: torch.Tensor, accept_index: torch.Tensor | None, positions: list[int],
                 num_draft_tokens: int) -> None:
        self.aux = aux  # (bs * D, K*H), the forward's own
        self.final = final  # (bs * D, H)
        self.accept_index = accept_index  # (bs, W); None: a decode forward (D = W = 1, request i's row is row i)
        self.positions = positions
        self.num_draft_tokens = num_draft_tokens
        self.width = 1 if accept_index is None else accept_index.shape[1]
        self.held_nbytes = self.share_nbytes = aux.nbytes + final.nbytes
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None = None

    def arrays(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows [start, end) of one request's W (numpy views of the bytes; the final rows gathered): the aux rows at
        the front of its block of num_draft_tokens, the final rows along its accepted path (as
        `RowCopier.gather_verify` lays them out)."""
        slot, first = divmod(start, self.width)
        last = end - slot * self.width
        assert 0 <= first <= last <= self.width, "a piece lies within one request's rows"
        position = self.positions[slot]
        block = position * self.num_draft_tokens
        if self._arrays is None:  # made once a block: the captures of a step share it (a race makes them twice)
            self._arrays = (_ints(self.aux), _ints(self.final),
                            None if self.accept_index is None else self.accept_index.numpy())
        aux, final, accept_index = self._arrays
        if accept_index is None:  # a decode forward's row
            return aux[block + first : block + last], final[block + first : block + last]
        path = np.maximum(accept_index[position, first:last], 0)  # (n,): -1 past the path's end reads row 0
        return aux[block + first : block + last], final.take(path, axis=0)  # an index past the rows raises, as before


class ForwardRows(_KeptOutputs):
    """An extend forward's outputs kept by reference (on CPU: `DeferredHostCopier.keep_rows`): each captured
    request's rows are a piece of it, [start, end) of the forward's rows, read off the scheduler's thread only
    (`arrays`: by `RowCopier.join_all` on the copy thread, `CapturedSequence.state_arrays` on the sender's)."""

    __slots__ = ("aux", "final", "held_nbytes", "share_nbytes", "_arrays")

    def __init__(self, aux: torch.Tensor, final: torch.Tensor, held_nbytes: int) -> None:
        self.aux = aux  # (rows, K*H), the forward's own
        self.final = final  # (rows, H)
        self.held_nbytes = self.share_nbytes = held_nbytes
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None

    def arrays(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows [start, end) of the forward's outputs (numpy views of their bytes)."""
        if self._arrays is None:  # made once: the captures of a forward share it (a race makes them twice)
            self._arrays = (_ints(self.aux), _ints(self.final))
        aux, final = self._arrays
        return aux[start:end], final[start:end]


RowPiece = tuple["HostRows | VerifyRows | ForwardRows", int, int]
"""Rows [start, end) of a block that others share (a verify step's): one holder of its lease, if it has one."""


class CopyFailed(ValueError):
    """A copy job failed on the copy thread; the capture whose rows it was copying cannot be sent."""


class _Done:
    """A job's completion: a lock held from the job's submission until it ran (a lock costs a tenth of an
    `Event`'s few microseconds, and a join is made on the scheduler's thread)."""

    __slots__ = ("_lock", "error")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self.error: BaseException | None = None

    def set(self) -> None:
        self._lock.release()

    def is_set(self) -> bool:
        return not self._lock.locked()

    def wait(self) -> None:
        with self._lock:  # free once the job ran; each waiter passes it on
            pass
        if self.error is not None:
            raise CopyFailed(f"copying captured rows failed: {type(self.error).__name__}: {self.error}")


class CopyJobs:
    """One daemon thread that runs copy jobs in the order they were queued (started at the first job).

    Its copies are numpy's (single-threaded, GIL released), for the reason `host_copy` gives. Like the sender
    thread it runs `nice` lower than the server (Linux, per thread): the forward's threads go first."""

    def __init__(self, name: str = "eagle-tap-copy", nice: int = 10,
                 count_cpu: Callable[[int], None] | None = None) -> None:
        self._name = name
        self._nice = nice
        self._count_cpu = count_cpu
        """Given the thread CPU (ns) of each job and of freeing what it held (the plugin: `copy_cpu_ns`)."""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> Callable[[], None]:
        """Queues job; returns what waits until it ran (raising CopyFailed if it failed). Never blocks."""
        return self.submit_all([job])[0]

    def submit_all(self, jobs: list[Callable[[], None]]) -> list[Callable[[], None]]:
        """Queues jobs as one hand-over (one wake of the thread, which runs them in order); returns what waits
        for each (a job that fails fails only its own waiter). Never blocks."""
        queued = [[job, _Done()] for job in jobs]
        waits = [done.wait for _, done in queued]
        self._queue.put(queued)
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
        return waits

    def _run(self) -> None:
        if self._nice > 0 and hasattr(os, "setpriority"):
            try:
                thread_id = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, thread_id, min(os.getpriority(os.PRIO_PROCESS, thread_id) + self._nice, 19))
            except OSError:
                pass  # copies then compete with the forward as the scheduler's own would
        while True:
            queued = self._queue.get()
            for entry in queued:
                job, done = entry
                entry.clear()
                started_ns = time.thread_time_ns()
                try:
                    job()
                except BaseException as error:  # counted where the rows are read (`CopyFailed`), never raised here
                    done.error = error
                # The job's references to the forward's tensors go now, not at the next job, and before its waiter
                # learns it ran: a tensor freed on this daemon thread while the interpreter shuts down (the waiter
                # was the last thing the main thread did) takes the GIL in its deleter and aborts the process.
                del job
                if self._count_cpu is not None:
                    try:
                        self._count_cpu(time.thread_time_ns() - started_ns)
                    except Exception:  # a count never keeps the waiter waiting
                        pass
                done.set()
                del done
            del queued


_SAME_WIDTH_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _ints(rows: torch.Tensor) -> np.ndarray:
    """A numpy view of rows' bytes as integers of their width (numpy has no bfloat16)."""
    return rows.view(_SAME_WIDTH_INTS[rows.element_size()]).numpy()


def release_pieces(pieces: Sequence[RowPiece]) -> None:
    """Gives up each piece's hold on its lease (a no-op for rows without one)."""
    for rows, _, _ in pieces:
        if rows.lease is not None:
            rows.lease.release_one()


class RowCopier:
    """Copies the captured rows of one forward to host memory: one HostRows per range, or None (dropped)."""

    _jobs: CopyJobs | None = None
    copy_thread_nice = 10
    """How much lower the copy thread's priority is than the server's (the hook sets EAGLE_TAP_SENDER_NICE's)."""
    count_copy_cpu: Callable[[int], None] | None = None
    """Given the copy thread's CPU (ns) of each job (the hook: the stats' `copy_cpu_ns`)."""

    @property
    def jobs(self) -> CopyJobs:
        """The copy thread of this copier (joins, and on CPU every copy)."""
        if self._jobs is None:
            self._jobs = CopyJobs(nice=self.copy_thread_nice, count_cpu=self.count_copy_cpu)
        return self._jobs

    def copy(self, aux: torch.Tensor, final: torch.Tensor, ranges: RowRanges) -> list[HostRows] | None:
        raise NotImplementedError

    keeps_references = False
    """Whether the blocks of `gather_verify`, `gather_decode` and `keep_rows` are references to a forward's outputs
    (kept alive whole by any piece of them) rather than copies."""

    def keep_rows(self, aux: torch.Tensor, final: torch.Tensor) -> ForwardRows | None:
        """An extend forward's outputs kept by reference, its captured rows to be read later as pieces of it
        (`ForwardRows`), or None: copy them (`copy`). Only where the outputs stay valid after the hook returns
        and holding them costs less than copying (`DeferredHostCopier`)."""
        return None

    def gather_decode(self, aux: torch.Tensor, final: torch.Tensor,
                      positions: list[int]) -> HostRows | VerifyRows | None:
        """The rows of one decode forward (row i: request i's newest token) of the requests at `positions`, as one
        block of one row per position, in order; its lease (if any) has one holder per position. None: dropped."""
        return self.gather_verify(aux, final, None, positions, 1)

    def gather_verify(self, aux: torch.Tensor, final: torch.Tensor, accept_index: torch.Tensor | None,
                      positions: list[int], num_draft_tokens: int) -> HostRows | VerifyRows | None:
        """The candidate rows of one verify forward for the requests at `positions` (batch order), as one block
        of n * W rows, W = accept_index.shape[1]: request i's W rows at [i * W, (i + 1) * W), the aux rows at
        the front of its block of num_draft_tokens and the final rows along its accepted path (`accept_index`,
        -1 past its end: any row). Its lease (if any) has one holder per position. None: no room (dropped).
        accept_index None: a decode forward (`gather_decode`)."""
        if accept_index is None:
            rows = torch.tensor(positions, dtype=torch.int64, device=aux.device)
            return self._copy_block(aux[rows], final[rows.to(final.device)], positions, 1)  # (n, K*H), (n, H)
        width = accept_index.shape[1]
        rows = torch.tensor(positions, dtype=torch.int64, device=accept_index.device)
        # Top-k 1: the accepted path is the front of each block. Top-k > 1: SGLang has moved the path's aux
        # rows to the front already, not the final states, which are gathered along the path itself.
        front = (rows[:, None] * num_draft_tokens
                 + torch.arange(width, dtype=torch.int64, device=rows.device)).reshape(-1)  # (n * W,)
        path = accept_index[rows].to(torch.int64).clamp(min=0).reshape(-1)  # (n * W,)
        aux_rows, final_rows = aux[front.to(aux.device)], final[path.to(final.device)]  # (n*W, K*H), (n*W, H)
        return self._copy_block(aux_rows, final_rows, positions, width)

    def _copy_block(self, aux_rows: torch.Tensor, final_rows: torch.Tensor, positions: list[int],
                    width: int) -> HostRows | None:
        copied = self.copy(aux_rows, final_rows, [(0, len(positions) * width)])
        if copied is None:
            return None
        block = copied[0]
        if block.lease is not None:
            for _ in positions[1:]:
                block.lease.add_holder()
        return block

    def join_all(self, runs: Sequence[Sequence[RowPiece]]) -> list[HostRows]:
        """For each run of pieces (a capture's rows), one HostRows of its rows, in order, copied on the copy thread
        (which first waits for each piece's own copy); each piece's hold on its lease is given up once its rows are
        copied. The runs are handed to the copy thread at once: the scheduler's thread pays one hand-over and one
        wake for all of them, the allocations of each."""
        outputs = [_empty_rows(pieces) for pieces in runs]
        waits = self.jobs.submit_all([functools.partial(_copy_pieces, pieces, aux, final)
                                      for pieces, (aux, final) in zip(runs, outputs)])
        return [HostRows(aux=aux, final=final, ready=ready) for (aux, final), ready in zip(outputs, waits)]


def _empty_rows(pieces: Sequence[RowPiece]) -> tuple[torch.Tensor, torch.Tensor]:
    num_rows = sum(end - start for _, start, end in pieces)
    first = pieces[0][0]
    aux = torch.empty((num_rows, first.aux.shape[1]), dtype=first.aux.dtype)  # (R, K*H)
    final = torch.empty((num_rows, first.final.shape[1]), dtype=first.final.dtype)  # (R, H)
    return aux, final


def _copy_pieces(pieces: Sequence[RowPiece], aux: torch.Tensor, final: torch.Tensor) -> None:
    """The pieces' rows into aux and final, in order (numpy: one thread, no OpenMP team); each piece's hold on its
    lease is given up, copied or not."""
    try:
        arrays = [rows.arrays(start, end) for rows, start, end in pieces]
        np.concatenate([piece_aux for piece_aux, _ in arrays], out=_ints(aux))
        np.concatenate([piece_final for _, piece_final in arrays], out=_ints(final))
    finally:
        release_pieces(pieces)


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
    """The plain copy, one per request, on the calling thread: on CPU where the forward's outputs may be
    overwritten after the hook returns (a CPU graph runner: see `DeferredHostCopier`)."""

    def copy(self, aux: torch.Tensor, final: torch.Tensor, ranges: RowRanges) -> list[HostRows]:
        return [HostRows(aux=host_copy(aux[start:end]),  # (n, K*H)
                         final=host_copy(final[start:end]))  # (n, H)
                for start, end in ranges]


def _whole_storage(rows: torch.Tensor) -> bool:
    """Whether rows is all of its storage (a reference to it holds no byte more than rows)."""
    return rows.is_contiguous() and rows.untyped_storage().nbytes() == rows.nbytes


class DeferredHostCopier(RowCopier):
    """On CPU: the scheduler's thread keeps references to the forward's output tensors and queues their
    copy on the copy thread (`CopyJobs`); when the captured rows are all of those tensors, the references
    are kept and nothing is copied (a copy would free nothing).

    Why a reference stays valid, read in SGLang 0.5.23's source: on CPU without a CPU graph runner
    (`--enable-torch-compile`: `model_runner_components/cuda_graph_setup.py` builds no graph runner on CPU
    otherwise) every forward allocates its outputs anew: the aux states are `torch.cat` of the layers'
    inputs in `LogitsProcessor`, the final states the final norm's output, and a verify forward's
    `_compact_accept_to_front` (`speculative/eagle_worker_common.py`, top-k > 1) assigns a gathered clone
    to `logits_output.hidden_states` before the hook runs rather than writing in place; `accept_index`
    is a new tensor of each verify step. Nothing in SGLang writes into them after the forward (CPU memory
    is not handed from one forward to the next by a caching allocator, and a tensor held here is not
    freed), so the bytes read later on the copy thread are those the forward wrote. With a CPU graph
    runner the outputs come from a compiled graph whose buffers we have not proven fresh per replay: the
    hook then copies on its own thread (`HostCopier`), as before.

    An extend forward's outputs up to `keep_max_bytes` are kept by reference too (`keep_rows`), its captured rows
    pieces of them joined as a step's are. A decode or verify forward's rows are not copied at all until a
    capture's kept rows are joined
    (`gather_decode` and `gather_verify` return references, `VerifyRows`): the scheduler's thread runs no tensor
    operation for a decode or verify step. A capture joins its rows at least every 64 steps, and all captures join
    theirs at once when the outputs they keep alive together reach 64 MiB (`capture._RUN_MAX_STEPS`,
    `_RUN_MAX_BYTES`)."""

    keep_max_bytes = 4 << 20
    """An extend forward's outputs up to this size are kept by reference (`keep_rows`) rather than their
    captured rows copied: on the scheduler's thread, cold after the forward, the copy's two allocations, its
    hand-over to the copy thread and the HostRows cut from it cost ~100 us whatever the bytes; a reference costs
    a few. Bounded so that a few captured rows never keep a large forward alive (the captures join their pieces
    once the forwards they keep alive reach `capture._RUN_MAX_BYTES`; the sender counts what they keep alive in
    flight)."""

    keeps_references = True

    def keep_rows(self, aux: torch.Tensor, final: torch.Tensor) -> ForwardRows | None:
        held = aux.untyped_storage().nbytes() + final.untyped_storage().nbytes()
        if held > self.keep_max_bytes:
            return None
        return ForwardRows(aux, final, held)

    def copy(self, aux: torch.Tensor, final: torch.Tensor, ranges: RowRanges) -> list[HostRows]:
        num_rows = sum(end - start for start, end in ranges)
        if num_rows == aux.shape[0] == final.shape[0] and _whole_storage(aux) and _whole_storage(final):
            return [HostRows(aux=aux[start:end], final=final[start:end]) for start, end in ranges]  # references
        host_aux = torch.empty((num_rows, aux.shape[1]), dtype=aux.dtype)  # (N, K*H)
        host_final = torch.empty((num_rows, final.shape[1]), dtype=final.dtype)  # (N, H)

        def job() -> None:
            source_aux, source_final = _ints(aux), _ints(final)
            np.concatenate([source_aux[start:end] for start, end in ranges], out=_ints(host_aux))
            np.concatenate([source_final[start:end] for start, end in ranges], out=_ints(host_final))

        return _cut_rows(host_aux, host_final, ranges, ready=self.jobs.submit(job))

    def gather_verify(self, aux: torch.Tensor, final: torch.Tensor, accept_index: torch.Tensor | None,
                      positions: list[int], num_draft_tokens: int) -> VerifyRows:
        # References only: `join` reads the rows kept of each step straight from the forward's outputs.
        return VerifyRows(aux, final, accept_index, positions, num_draft_tokens)


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
    return host_aux, host_final, _cut_rows(host_aux, host_final, ranges, lease=lease)


def _cut_rows(host_aux: torch.Tensor, host_final: torch.Tensor, ranges: RowRanges, *,
              ready: Callable[[], None] | None = None, lease: SlabLease | None = None) -> list[HostRows]:
    """One HostRows per range, cut in order from rows laid out back to back in host_aux (N, K*H) and
    host_final (N, H)."""
    rows, offset = [], 0
    for start, end in ranges:
        count = end - start
        rows.append(HostRows(aux=host_aux[offset : offset + count], final=host_final[offset : offset + count],
                             ready=ready, lease=lease))
        offset += count
    return rows


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
