"""Object collectives: picklable Python objects of any (unequal) sizes.

As torch does: each object is pickled to bytes, the members exchange the byte sizes
first (a small int32 collective, which also carries the check that every member made
the same call), then the bytes padded to the largest size (a uint8 collective), and
unpickle: two round trips per call. Lists are filled in place as in torch, and also returned.

Pickle runs code when loading: only use these with processes you trust (as torch warns).
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from jdist.collectives import _engine as eng
from jdist.collectives import _fingerprint as fpr
from jdist.collectives import functional as F
from jdist.collectives._eager import _fp, dispatch, group_root
from jdist.collectives._group import ProcessGroup

__all__ = ["all_gather_object", "broadcast_object_list", "gather_object",
           "scatter_object_list"]


def _bytes(obj: Any) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)


def _bucket(n: int) -> int:
    """Padded byte length: the next power of two (at least 64), to bound compilations."""
    return max(64, 1 << max(0, int(n) - 1).bit_length())


def _load(buf: np.ndarray, size: int) -> Any:
    return pickle.loads(np.asarray(buf[:size]).tobytes())


def _checked(fp):
    """``fp`` when checks are on: the collective then compares it in the same program."""
    return fp if fpr.debug_enabled() else None


def _allgather(g: ProcessGroup, what: str, x: np.ndarray, fp=None) -> np.ndarray:
    axis = g.axis_name

    def build():
        return lambda v: F.all_gather(v[0], axis, axis=0, tiled=False)[None]

    return eng.run(g, what, ("all_gather",), build, x, tuple(x.shape), x.dtype, fp, False)


def _bcast(g: ProcessGroup, what: str, x: np.ndarray, root: int, fp=None) -> np.ndarray:
    axis = g.axis_name

    def build():
        return lambda v: F.broadcast(v, root, axis)

    return eng.run(g, what, ("broadcast", root), build, x, tuple(x.shape), x.dtype, fp,
                   False)


def _gather_objects(g: ProcessGroup, what: str, obj: Any, fp) -> list:
    data = _bytes(obj)  # the call check rides on the sizes' collective: two round trips
    sizes = _allgather(g, what, np.array([data.size], np.int32), _checked(fp))[:, 0]
    padded = np.zeros((_bucket(sizes.max()),), np.uint8)
    padded[: data.size] = data
    rows = _allgather(g, what, padded)
    return [_load(rows[i], int(sizes[i])) for i in range(g.size())]


def _fill(out_list, values, what: str) -> None:
    if out_list is None:
        return
    if len(out_list) != len(values):
        raise ValueError(f"jdist.{what}: the output list has {len(out_list)} entries, "
                         f"expected {len(values)} (one per member)")
    out_list[:] = values


def all_gather_object(object_list, obj: Any, group: ProcessGroup | None = None) -> list:
    """Every member gets every member's ``obj`` (``object_list[i]`` = group rank i's).

    ``object_list`` (length = group size, or None) is filled in place; returns the list.
    """
    g = eng.member_group(group, "all_gather_object")
    if g is None:
        return None
    if object_list is not None and len(object_list) != g.size():
        _fill(object_list, [None] * g.size(), "all_gather_object")

    def fn():
        values = _gather_objects(g, "all_gather_object", obj, _fp(g, "all_gather_object"))
        _fill(object_list, values, "all_gather_object")
        return values if object_list is None else object_list

    return dispatch(g, "all_gather_object", fn, False)


def gather_object(obj: Any, object_gather_list=None, dst: int | None = None,
                  group: ProcessGroup | None = None, group_dst: int | None = None):
    """``dst`` gets every member's ``obj``; returns the list on ``dst``, None elsewhere."""
    g = eng.member_group(group, "gather_object")
    if g is None:
        return None
    root = group_root(g, dst, group_dst, "dst", "gather_object")

    def fn():
        values = _gather_objects(g, "gather_object", obj,
                                 _fp(g, "gather_object", root=root))
        if g.rank != root:
            return None
        _fill(object_gather_list, values, "gather_object")
        return values if object_gather_list is None else object_gather_list

    return dispatch(g, "gather_object", fn, False)


def broadcast_object_list(object_list: list, src: int | None = None,
                          group: ProcessGroup | None = None, device=None,
                          group_src: int | None = None) -> list:
    """Every member's ``object_list`` becomes ``src``'s (same length on every member).

    The list is updated in place and returned.
    """
    del device
    g = eng.member_group(group, "broadcast_object_list")
    if g is None:
        return None
    root = group_root(g, src, group_src, "src", "broadcast_object_list")
    n_obj = len(object_list)

    def fn():
        fp = _checked(_fp(g, "broadcast_object_list", root=root, count=n_obj))
        if g.rank == root:
            parts = [_bytes(o) for o in object_list]
            sizes = np.array([p.size for p in parts], np.int32)
        else:
            parts, sizes = [], np.zeros((n_obj,), np.int32)
        sizes = _bcast(g, "broadcast_object_list", sizes, root, fp)
        buf = np.zeros((_bucket(sizes.sum()),), np.uint8)
        if g.rank == root and parts:
            buf[: int(sizes.sum())] = np.concatenate(parts)
        buf = _bcast(g, "broadcast_object_list", buf, root)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        values = [_load(buf[offsets[i]:], int(sizes[i])) for i in range(n_obj)]
        object_list[:] = values
        return object_list

    return dispatch(g, "broadcast_object_list", fn, False)


def scatter_object_list(scatter_object_output_list: list, scatter_object_input_list=None,
                        src: int | None = None, group: ProcessGroup | None = None,
                        group_src: int | None = None):
    """Member i gets ``scatter_object_input_list[i]`` from ``src``.

    It is written to ``scatter_object_output_list[0]`` (as torch) and returned.
    """
    g = eng.member_group(group, "scatter_object_list")
    if g is None:
        return None
    root = group_root(g, src, group_src, "src", "scatter_object_list")
    n = g.size()
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError("Expected argument scatter_object_output_list to be a list of size "
                         "at least 1. (jdist.scatter_object_list writes the result to entry "
                         f"0; got {scatter_object_output_list!r:.60})")
    if g.rank == root and scatter_object_input_list is None:
        raise ValueError("jdist.scatter_object_list: source rank must provide non-None "
                         f"scatter_object_input_list (a list of {n} objects, one per member)")
    if g.rank == root and len(scatter_object_input_list) != n:
        raise ValueError(f"jdist.scatter_object_list: src needs an input list of {n} "
                         f"objects, got {len(scatter_object_input_list)}")

    def fn():
        fp = _checked(_fp(g, "scatter_object_list", root=root))
        if g.rank == root:
            parts = [_bytes(o) for o in scatter_object_input_list]
            sizes = np.array([p.size for p in parts], np.int32)
        else:
            parts, sizes = [], np.zeros((n,), np.int32)
        sizes = _bcast(g, "scatter_object_list", sizes, root, fp)
        width = _bucket(sizes.max())
        table = np.zeros((n, width), np.uint8)
        for i, p in enumerate(parts):
            table[i, : p.size] = p
        axis = g.axis_name

        def build():
            return lambda v: F.all_to_all(v[0], 0, 0, axis, tiled=True)[None]

        rows = eng.run(g, "scatter_object_list", ("all_to_all",), build, table,
                       tuple(table.shape), table.dtype, None, False)
        value = _load(rows[root], int(sizes[g.rank]))
        scatter_object_output_list[0] = value
        return value

    return dispatch(g, "scatter_object_list", fn, False)
