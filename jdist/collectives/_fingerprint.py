"""Collective fingerprints: what each rank is about to run, as a fixed int32 vector.

Before an eager collective, every member all-gathers its fingerprint (one tiny XLA
program of fixed shape, so it always matches across ranks) and compares them. A
difference raises :class:`jdist.errors.CollectiveMismatchError` on *every* rank, naming
each rank's call, instead of torch/gloo's silently wrong result on one rank and a
timeout on the other. ``JDIST_DEBUG=OFF`` skips the check.

Layout of the vector (``FP_LEN`` int32): magic, sequence number, kind, op, dtype,
root (src/dst, -1 if none), count (list length, -1 if none), ndim, then the first 8 dims
(the 8th holds a hash of the full shape when there are more than 8 dims).
"""

from __future__ import annotations

import functools
import os
import threading
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from jdist.collectives._types import ReduceOp
from jdist.errors import CollectiveMismatchError

__all__ = ["FP_LEN", "KINDS", "encode", "describe", "check", "debug_enabled", "issued"]

FP_LEN = 16
_MAGIC = 0x6A64  # "jd"
_MAX_DIMS = 8

KINDS = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "all_to_all",
    "barrier", "send/recv", "all_gather_object", "broadcast_object_list",
    "gather_object", "scatter_object_list", "all_to_all_sizes",
)
_KIND_CODE = {k: i for i, k in enumerate(KINDS)}
_OPS = tuple(ReduceOp)
_DTYPES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
)
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}


_PINNED = threading.local()


def debug_enabled() -> bool:
    """Mismatch detection is on unless ``JDIST_DEBUG=OFF``: read on every call, or the
    value pinned when a queued operation was issued (:func:`issued`)."""
    pinned = getattr(_PINNED, "mode", None)
    if pinned is not None:
        return pinned
    return os.environ.get("JDIST_DEBUG", "").upper() != "OFF"


def issued(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` to run later on another thread under the check mode in force now.

    Whether a call is checked changes the programs it runs (one fused program, or two,
    or none), so every member must decide alike. A program that switches
    ``JDIST_DEBUG`` between issuing an async collective and its execution on the
    group's worker thread would otherwise have ranks run different programs: a hang.
    """
    mode = debug_enabled()

    def run() -> Any:
        _PINNED.mode = mode
        try:
            return fn()
        finally:
            _PINNED.mode = None

    return run


def _clip(v: int) -> int:
    return v if 0 <= v < 2**31 - 1 else zlib.crc32(str(v).encode()) & 0x7FFFFFFF


def encode(seq: int, kind: str, op: ReduceOp | None = None, shape=(), dtype=None,
           root: int = -1, count: int = -1) -> np.ndarray:
    """The int32 fingerprint of one call (pure): a copy of the call's cached fixed part
    with ``seq`` written in (an eager call encodes one; this is on every call's path)."""
    try:
        fixed = _fixed(kind, op, tuple(shape), dtype, root, count)
    except TypeError:  # an unhashable dimension or dtype: encode without the cache
        fixed = _fixed.__wrapped__(kind, op, tuple(shape), dtype, root, count)
    fp = fixed.copy()
    fp[1] = seq & 0x7FFFFFFF
    return fp


@functools.lru_cache(maxsize=4096)
def _fixed(kind: str, op, shape: tuple, dtype, root: int, count: int) -> np.ndarray:
    """Every field of :func:`encode` but the sequence number (read-only; do not write)."""
    fp = np.full((FP_LEN,), -1, np.int32)
    shape = tuple(int(d) for d in shape)
    fp[0] = _MAGIC
    fp[2] = _KIND_CODE[kind]
    fp[3] = -1 if op is None else _OPS.index(op)
    if dtype is not None:
        name = np.dtype(dtype).name
        fp[4] = _DTYPE_CODE.get(name, 100 + (zlib.crc32(name.encode()) & 0xFFFF))
    fp[5] = root
    fp[6] = count
    fp[7] = len(shape)
    for i, d in enumerate(shape[:_MAX_DIMS]):
        fp[8 + i] = _clip(d)
    if len(shape) > _MAX_DIMS:
        fp[8 + _MAX_DIMS - 1] = zlib.crc32(repr(shape).encode()) & 0x7FFFFFFF
    fp.flags.writeable = False
    return fp


def describe(fp: np.ndarray) -> str:
    """Human-readable form of a fingerprint (pure), e.g. ``all_reduce #3 (shape=(2,), ...)``."""
    fp = [int(v) for v in np.asarray(fp).reshape(-1)]
    if fp[0] != _MAGIC:
        return f"an unknown call (fingerprint {fp})"
    kind = KINDS[fp[2]] if 0 <= fp[2] < len(KINDS) else f"kind {fp[2]}"
    parts = []
    if fp[4] >= 0:
        ndim = fp[7]
        dims = fp[8:8 + min(ndim, _MAX_DIMS)]
        shape = tuple(dims) if ndim <= _MAX_DIMS else (*dims[:-1], "...")
        parts.append(f"shape={shape}")
        parts.append("dtype=" + (_DTYPES[fp[4]] if fp[4] < len(_DTYPES) else f"#{fp[4]}"))
    if fp[3] >= 0:
        parts.append(f"op={_OPS[fp[3]].name}")
    if fp[5] >= 0:
        parts.append(f"root={fp[5]}")
    if fp[6] >= 0:
        parts.append(f"count={fp[6]}")
    return f"{kind} #{fp[1]} ({', '.join(parts)})"


def _skip_hint() -> str:
    if debug_enabled():
        return "set JDIST_DEBUG=OFF to skip this check"
    return ("JDIST_DEBUG=OFF skips the check only where it costs an exchange of its own; "
            "a call small enough for one collective carries its fingerprint anyway")


def check(fps: np.ndarray, ranks, group_name: str) -> None:
    """Raise :class:`CollectiveMismatchError` unless all rows of ``fps`` are equal.

    Args:
      fps: ``[n, FP_LEN]`` fingerprints, row i from the group's member i.
      ranks: WORLD rank of each row.
      group_name: for the message.
    """
    fps = np.asarray(fps)
    if (fps == fps[0]).all():
        return
    calls = "; ".join(
        f"rank {r} is running {describe(fp)}" for r, fp in zip(ranks, fps, strict=True))
    raise CollectiveMismatchError(
        f"Detected mismatch between collectives on ranks of group {group_name!r}: {calls}. "
        f"Make every rank call the same collectives in the same order with the same "
        f"shapes, dtypes and arguments ({_skip_hint()})"
    )
