"""Receive buffers, reused across requests.

Why: a fresh multi-MB bytearray is a fresh mmap whose every page faults on first write; in
measurements here that, not the socket, dominated receive cost. A body is copied once, chunk by
chunk, into one buffer sized from its frame prefix, and the buffer goes back to the pool after the
writer has written it.

What must hold: the pool is used from the event loop thread only; a buffer is released once, after
nothing reads it any more (the writer thread has returned from writing it); the free buffers kept
never exceed max_pooled_bytes in total, and the buffers lent never exceed max_lent_bytes (so many
slow or stalled senders cannot make the service allocate without bound).
"""

from __future__ import annotations

__all__ = ["BufferPool", "BuffersExhausted"]

_POOLED_MIN_NBYTES = 1 << 20
"""Smaller bodies come from malloc's arenas cheaply: pooling them would only hold memory."""
_GRANULE_NBYTES = 1 << 20
"""Pooled buffers are whole MiB, so frames of slightly different sizes share buffers."""


class BuffersExhausted(Exception):
    """Lending another buffer would exceed max_lent_bytes: the service is receiving too much at once."""


class BufferPool:
    """Best-fit free list of bytearrays; bounded in what it keeps and in what it lends at once."""

    def __init__(self, max_pooled_bytes: int, max_lent_bytes: int) -> None:
        self.max_pooled_bytes = max_pooled_bytes
        self.max_lent_bytes = max_lent_bytes
        self._free: list[bytearray] = []
        self._pooled_bytes = 0
        self.lent_bytes = 0
        self.num_reused = 0
        self.num_allocated = 0

    @property
    def pooled_bytes(self) -> int:
        return self._pooled_bytes

    def acquire(self, nbytes: int) -> bytearray:
        """A buffer of at least nbytes (contents undefined); release it when done. BuffersExhausted if
        that would put more than max_lent_bytes in buffers being filled or waiting for the writer."""
        if self.lent_bytes + nbytes > self.max_lent_bytes:
            raise BuffersExhausted(
                f"{self.lent_bytes} bytes are being received or written; {nbytes} more would exceed "
                f"max_inflight_bytes={self.max_lent_bytes}"
            )
        buffer = self._take(nbytes)
        self.lent_bytes += len(buffer)
        return buffer

    def _take(self, nbytes: int) -> bytearray:
        if nbytes >= _POOLED_MIN_NBYTES:
            best = -1
            for position, buffer in enumerate(self._free):
                if len(buffer) >= nbytes and (best < 0 or len(buffer) < len(self._free[best])):
                    best = position
            if best >= 0:
                buffer = self._free.pop(best)
                self._pooled_bytes -= len(buffer)
                self.num_reused += 1
                return buffer
            nbytes = -(-nbytes // _GRANULE_NBYTES) * _GRANULE_NBYTES
        self.num_allocated += 1
        return bytearray(nbytes)

    def release(self, buffer: bytearray) -> None:
        """Takes back a buffer from acquire; keeps it for reuse if it is worth pooling and fits."""
        self.lent_bytes -= len(buffer)
        if len(buffer) < _POOLED_MIN_NBYTES or len(buffer) > self.max_pooled_bytes:
            return
        self._free.append(buffer)
        self._pooled_bytes += len(buffer)
        while self._pooled_bytes > self.max_pooled_bytes:
            evicted = self._free.pop(0)  # the oldest: the working set of sizes moves with the traffic
            self._pooled_bytes -= len(evicted)
