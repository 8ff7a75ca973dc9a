"""``ArrayLoader``: batches gathered from memory-mapped or random-access data.

Each batch's rows are read when the batch is made, never the whole set: numpy arrays by
one fancy-indexing read per batch, any other object with ``__getitem__`` and ``__len__``
item by item (stacked with ``numpy_collate``).

A memory-mapped file stays out of the process's resident memory. Indexing a memory map
maps every page it touches into the process (and the kernel maps neighbouring pages
with each fault), where they count as resident until the process ends: an epoch over a
file larger than memory would grow the process to the file's size. So rows of a
C-contiguous memory-mapped array are read from its file with ``os.preadv`` straight
into the batch (in file order; the file's pages stay in the page cache, outside the
process), and other memory maps hand their pages back to the kernel after each batch
(``madvise(MADV_DONTNEED)``). Copy-on-write maps (``mode="c"``) are indexed as they
are: their pages may hold changes that are not in the file.
"""

from __future__ import annotations

import itertools
import mmap
import operator
import os

import numpy as np

from jdist.sampler._collate import numpy_collate
from jdist.sampler._indices import dataset_length
from jdist.sampler._resumable import ResumableLoader

__all__ = ["ArrayLoader"]

_SAFE_MODES = ("r", "readonly", "r+", "readwrite")  # never "c": its pages are private


def _mapping(x):
    """``(top np.memmap, its mmap.mmap)`` under ``x`` if its pages may be read from the
    file or released, else None."""
    top = None
    base = x
    while base is not None and not isinstance(base, mmap.mmap):
        if isinstance(base, np.memmap):
            top = base
        base = getattr(base, "base", None)
    if (isinstance(base, mmap.mmap) and top is not None
            and getattr(top, "mode", None) in _SAFE_MODES):
        return top, base
    return None


class _FileRows:
    """Rows of a C-contiguous memory-mapped array, read with ``os.preadv``."""

    def __init__(self, x: np.ndarray, top: np.memmap) -> None:
        self.shape, self.dtype = x.shape[1:], x.dtype
        self.row_bytes = x.strides[0] if x.ndim else x.itemsize
        # x's first row in the file: the top map's data offset plus x's distance from it
        self.start = int(top.offset) + (x.ctypes.data - top.ctypes.data)
        self.fd = os.open(top.filename, os.O_RDONLY)

    def gather(self, idx: np.ndarray) -> np.ndarray:
        out = np.empty((len(idx),) + self.shape, self.dtype)
        buf = memoryview(out.reshape(-1).view(np.uint8))
        rb = self.row_bytes
        for k in np.argsort(idx, kind="stable").tolist():  # file order
            off = self.start + int(idx[k]) * rb
            got = os.preadv(self.fd, [buf[k * rb:(k + 1) * rb]], off)
            if got != rb:
                raise OSError(
                    f"read {got} of {rb} bytes of row {int(idx[k])} at offset {off}: the "
                    "file is shorter than its array header says (truncated?)"
                )
        return out

    def __del__(self, _close=os.close) -> None:  # os may be gone at interpreter exit
        fd, self.fd = getattr(self, "fd", None), None
        if fd is not None:
            _close(fd)


class _Leaf:
    """One array-like of the data: how to gather rows from it."""

    def __init__(self, x, path: str) -> None:
        if not (hasattr(x, "__getitem__") and hasattr(x, "__len__")):
            raise TypeError(
                f"data{path} is {type(x).__name__}, which has no __getitem__/__len__; pass "
                "numpy arrays (np.load(..., mmap_mode='r') for files), or an object with "
                "__getitem__ and __len__"
            )
        self.x, self.path = x, path
        self.array = isinstance(x, np.ndarray)
        if self.array and x.ndim == 0:
            raise ValueError(f"data{path} is a 0-d array; every array needs a sample axis")
        found = _mapping(x) if self.array else None
        self.file = self.mapping = None
        if found is not None:
            top, self.mapping = found
            rows_contiguous = x.flags.c_contiguous and x.dtype.hasobject is False
            if rows_contiguous and hasattr(os, "preadv") and x.ndim >= 1:
                self.file = _FileRows(x, top)
            elif not hasattr(self.mapping, "madvise"):
                self.mapping = None

    def __len__(self) -> int:
        return len(self.x)

    def gather(self, idx: np.ndarray):
        if self.file is not None:
            return self.file.gather(idx)
        if self.array:
            rows = np.asarray(self.x[idx])
            if self.mapping is not None:
                self.mapping.madvise(mmap.MADV_DONTNEED)
            return rows
        return numpy_collate([self.x[int(i)] for i in idx])


def _flatten(data, path=""):
    if isinstance(data, dict):
        return [leaf for k in data for leaf in _flatten(data[k], f"{path}[{k!r}]")]
    if isinstance(data, (tuple, list)) and not hasattr(data, "__array__"):
        return [leaf for i, v in enumerate(data) for leaf in _flatten(v, f"{path}[{i}]")]
    return [_Leaf(data, path)]


def _rebuild(data, values):
    if isinstance(data, dict):
        return {k: _rebuild(v, values) for k, v in data.items()}
    if isinstance(data, (tuple, list)) and not hasattr(data, "__array__"):
        parts = [_rebuild(v, values) for v in data]
        return type(data)(*parts) if hasattr(data, "_fields") else type(data)(parts)
    return next(values)


class _HostBatches:
    """One pass over the sampler: numpy batches of ``batch_size`` rows."""

    def __init__(self, sampler, data, leaves, batch_size, drop_last) -> None:
        self.sampler, self.data, self.leaves = sampler, data, leaves
        self.batch_size, self.drop_last = batch_size, drop_last
        self.sampler_length = len(leaves[0])

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _check_lengths(self) -> None:
        lengths = {leaf.path or "data": len(leaf) for leaf in self.leaves}
        if set(lengths.values()) != {self.sampler_length}:
            now = sorted(set(lengths.values()))
            raise ValueError(
                f"the data's length changed from {self.sampler_length} to "
                f"{now[0] if len(now) == 1 else now} rows ({lengths}) after the loader was "
                "made; make a new DistributedSampler and ArrayLoader for the new data"
            )

    def __iter__(self):
        self._check_lengths()
        it = iter(self.sampler)
        size, n = self.batch_size, self.sampler_length
        while True:
            idx = np.fromiter(itertools.islice(it, size), dtype=np.int64)
            if idx.size == 0 or (self.drop_last and idx.size < size):
                return
            if idx.min() < 0 or idx.max() >= n:
                bad = int(idx.max() if idx.max() >= n else idx.min())
                raise IndexError(
                    f"sampler gave index {bad} but the data has {n} rows; build the "
                    "sampler over len(data)"
                )
            yield _rebuild(self.data, iter([leaf.gather(idx) for leaf in self.leaves]))
            if idx.size < size:
                return


class ArrayLoader(ResumableLoader):
    """Batches of ``data`` rows in ``sampler``'s order, read lazily, prefetched to devices.

    For data larger than memory: pass memory-mapped arrays (``np.load(path,
    mmap_mode="r")`` or ``np.memmap``) and only the rows of the batches in flight are
    read; the mapping's pages are released after each batch (see the module notes).

    Args:
      sampler: a :class:`~jdist.sampler.DistributedSampler` over ``len(data)`` rows.
      data: an array, or a dict / tuple / list of arrays (nested) sharing their first
        dimension; arrays may be numpy (memory-mapped or not) or any object with
        ``__getitem__`` and ``__len__`` (read item by item and stacked).
      batch_size: rows per batch on this process.
      drop_last: drop the last batch of an epoch if it is short (keeps shapes fixed).
      place: where batches go; a ``DistributedDataParallel`` or ``ProcessGroup`` gives
        DDP's layout (the batch split over this process's devices). None: numpy.
      prefetch: batches read and placed ahead in a background thread (0: none).
      timeout: seconds to wait for one batch.

    Iterating gives one epoch (call ``sampler.set_epoch`` before each, as in torch);
    ``state_dict()`` / ``load_state_dict()`` resume at the batch in hand (see
    :class:`~jdist.sampler.ResumableLoader`).

    Raises:
      ValueError: arrays disagree on their length, or it differs from the sampler's
        dataset length; the batch (or the last batch, without ``drop_last``) does not
        split over the devices; the data's length changed between epochs (at ``iter``).
    """

    def __init__(self, sampler, data, batch_size: int, *, drop_last: bool = False,
                 place=None, prefetch: int = 1, timeout: float = 300.0) -> None:
        try:
            batch_size = operator.index(batch_size)
        except TypeError:
            raise TypeError(f"batch_size must be an int, got {batch_size!r}") from None
        if batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size}")
        leaves = _flatten(data)
        lengths = {leaf.path or "data": len(leaf) for leaf in leaves}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"every array needs the same number of rows; got {lengths}"
            )
        n = len(leaves[0])
        expected = dataset_length(getattr(sampler, "dataset", n))
        if expected != n:
            raise ValueError(
                f"the sampler is over {expected} samples but the data has {n} rows; build "
                f"the sampler over the data (DistributedSampler({n}, ...))"
            )
        self.batch_size, self.drop_last = batch_size, bool(drop_last)
        super().__init__(_HostBatches(sampler, data, leaves, batch_size, self.drop_last),
                         sampler, place=place, prefetch=prefetch, timeout=timeout)

    def __repr__(self) -> str:
        return (f"ArrayLoader(batch_size={self.batch_size}, drop_last={self.drop_last}, "
                f"sampler={self.sampler!r})")
