"""Receive buffers for large frames: fresh numpy memory, recycled once provably unused.

A received frame becomes the caller's array (``pickle`` rebuilds numpy arrays on top of
it), so it must be writable and owned by the receiver alone. Getting such memory from
the kernel is not free: every fresh page is faulted in and zeroed, which for a 64 MiB
frame costs about as much as moving it over loopback (and ``bytearray(n)`` is worse:
it zero-fills 4 KiB pages itself). Two things keep that cost down:

- the memory comes from ``numpy.empty`` (lazily mapped, huge pages where the kernel
  allows), never ``bytearray``;
- a small pool remembers the last large buffers handed out. Once nothing refers to one
  any more, it is handed out again instead of new memory. "Nothing refers to it" is
  exact: every array, memoryview or ``Py_buffer`` on a numpy array holds a reference to
  it (directly or through its base chain), so the pool reuses a buffer only when its
  reference count is back to the pool's own. At most :data:`POOL_BYTES` are kept this
  way; older entries are forgotten (and freed as usual once their users drop them).
"""

from __future__ import annotations

import collections
import sys
import threading

import numpy as np

__all__ = ["alloc_frame", "pooled_bytes", "POOL_MIN_BYTES", "POOL_BYTES"]

#: frames smaller than this come from plain ``numpy.empty`` (malloc reuses those itself)
POOL_MIN_BYTES = 1 << 20
#: upper bound on the memory the pool keeps referenced (in use or free)
POOL_BYTES = 256 << 20
_ROUND = 2 << 20  # sizes are rounded up to huge pages, so similar sizes share buffers

_lock = threading.Lock()
_pool: collections.deque[np.ndarray] = collections.deque()


def _refs(pool: collections.deque, i: int) -> int:
    """``pool[i]``'s reference count as seen from here (compared with :data:`_IDLE_REFS`)."""
    return sys.getrefcount(pool[i])


# what _refs reports for an entry nothing else refers to; measured through the same code
# rather than assumed, so interpreter details (temporaries, borrowed references) cancel
_IDLE_REFS = _refs(collections.deque([np.empty(1, np.uint8)]), 0)


def _rounded(nbytes: int) -> int:
    return -(-nbytes // _ROUND) * _ROUND


def alloc_frame(nbytes: int) -> memoryview:
    """A writable ``nbytes`` buffer (contents undefined) that nothing else refers to."""
    if nbytes < POOL_MIN_BYTES or nbytes > POOL_BYTES:
        return memoryview(np.empty(nbytes, np.uint8))
    size = _rounded(nbytes)
    with _lock:
        for i in range(len(_pool)):
            if _pool[i].nbytes == size and _refs(_pool, i) <= _IDLE_REFS:
                raw = _pool[i]
                del _pool[i]
                _pool.append(raw)  # most recently handed out last
                return memoryview(raw)[:nbytes]
        raw = np.empty(size, np.uint8)
        _pool.append(raw)
        total = sum(a.nbytes for a in _pool)
        while total > POOL_BYTES:
            total -= _pool.popleft().nbytes
        return memoryview(raw)[:nbytes]


def pooled_bytes() -> int:
    """Bytes the pool refers to now (in use or free); for tests and diagnostics."""
    with _lock:
        return sum(a.nbytes for a in _pool)
