"""``all_to_all`` and ``all_to_all_single``, with torch's uneven (per-peer) sizes.

Equal pieces go through one all-to-all of the ``[n, *piece]`` stack. Uneven pieces
(``all_to_all`` lists whose arrays differ in shape, ``all_to_all_single`` with split
sizes) take two steps, since an XLA program has one shape on every member: the
members agree on the largest piece (a checked max all-reduce of one int32), then each
piece is flattened and zero-padded to it, exchanged, and cut back to the size the
receiver expects (its output list's shapes, or ``output_split_sizes``), as torch's
``alltoallv`` delivers them.
"""

from __future__ import annotations

import jax
import numpy as np

from jdist.collectives import _engine as eng
from jdist.collectives import functional as F
from jdist.collectives._eager import (
    _exchange,
    _fill_list,
    _fp,
    _prep,
    _stack,
    _stack_padded,
    _write_back,
    dispatch,
)
from jdist.collectives._group import ProcessGroup
from jdist.collectives._inplace import check_kept
from jdist.collectives._result import as_results
from jdist.collectives._types import ReduceOp

__all__ = ["all_to_all", "all_to_all_single"]


def _agreed_width(g: ProcessGroup, what: str, local: int) -> int:
    """The largest piece (in elements) any member sends: one checked max all-reduce."""
    x = np.array([max(1, int(local))], np.int32)
    axis = g.axis_name
    out = eng.run(g, what, ("all_reduce", ReduceOp.MAX),
                  lambda: (lambda v: F.all_reduce(v, ReduceOp.MAX, axis)), x, (1,),
                  np.int32, _fp(g, "all_to_all_sizes", ReduceOp.MAX, (1,), np.int32), False)
    return int(np.asarray(out)[0])


def _exchange_uneven(g: ProcessGroup, what: str, pieces: list, receive: list[tuple],
                     dtype, as_jax: bool) -> list:
    """Piece j to member j; returns the pieces received, shaped as ``receive[j]``."""
    width = _agreed_width(g, what, max(int(np.prod(np.shape(p), dtype=np.int64))
                                       for p in pieces))
    xnp = jax.numpy if as_jax else np
    flat = _stack_padded([xnp.asarray(p, dtype) for p in pieces], as_jax)
    if flat.shape[1] < width:
        flat = xnp.pad(flat, ((0, 0), (0, width - flat.shape[1])))
    fp = _fp(g, "all_to_all", None, flat.shape, flat.dtype)
    rows = _exchange(g, what, flat, as_jax, fp)
    return [rows[j][:int(np.prod(shape, dtype=np.int64))].reshape(shape)
            for j, shape in enumerate(receive)]


def all_to_all(output_tensor_list, input_tensor_list, group: ProcessGroup | None = None,
               async_op: bool = False):
    """Member i's ``input_tensor_list[j]`` goes to member j as its ``output[i]``.

    The arrays may differ in shape from peer to peer (torch's uneven form); then
    ``output_tensor_list`` must be given, holding the shapes this member receives.
    Returns the output list (``output_tensor_list`` filled in place when given).
    """
    g = eng.member_group(group, "all_to_all")
    if g is None:
        return None
    n = g.size()
    inputs = input_tensor_list
    if inputs is None or len(inputs) != n:
        raise ValueError(f"jdist.all_to_all: expected a list of {n} input arrays (one per "
                         f"member), got {None if inputs is None else len(inputs)}")
    as_jax = any(isinstance(a, jax.Array) for a in inputs)
    shapes = {tuple(np.shape(a)) for a in inputs}
    outs = output_tensor_list
    if outs is not None:
        if len(outs) != n:
            raise ValueError(f"jdist.all_to_all: the output list has {len(outs)} entries but "
                             f"the group has {n} members; pass {n} arrays or None")
        shapes |= {tuple(np.shape(o)) for o in outs}
    if len(shapes) == 1:
        stacked = _stack(inputs, "all_to_all", n, as_jax)

        def fn():
            fp = _fp(g, "all_to_all", None, stacked.shape, stacked.dtype)
            values = as_results(_exchange(g, "all_to_all", stacked, as_jax, fp),
                                input_tensor_list[0], as_jax)
            return _fill_list(outs, values, "all_to_all")

        return dispatch(g, "all_to_all", fn, async_op)
    if outs is None:
        raise ValueError(
            f"jdist.all_to_all: the input arrays have different shapes "
            f"{[tuple(np.shape(a)) for a in inputs]}, so pass output_tensor_list with the "
            f"shape of each array this member receives (as torch requires)")
    dtype = np.result_type(*[np.asarray(a).dtype if not isinstance(a, jax.Array) else a.dtype
                             for a in inputs])
    receive = [tuple(np.shape(o)) for o in outs]

    def fn_uneven():
        values = _exchange_uneven(g, "all_to_all", list(inputs), receive, dtype, as_jax)
        return _fill_list(outs, values, "all_to_all")

    return dispatch(g, "all_to_all", fn_uneven, async_op)


def _splits(sizes, total: int, n: int, name: str) -> list[int]:
    if sizes is None:
        if total % n:
            raise ValueError(f"jdist.all_to_all_single: dim 0 of {name} ({total}) is not "
                             f"divisible by the group size {n}; pass {name}_split_sizes")
        return [total // n] * n
    sizes = [int(s) for s in sizes]
    if len(sizes) != n or any(s < 0 for s in sizes) or sum(sizes) != total:
        raise ValueError(f"jdist.all_to_all_single: {name}_split_sizes={sizes} must be {n} "
                         f"sizes >= 0 that add up to dim 0 of {name} ({total})")
    return sizes


def all_to_all_single(output, input, output_split_sizes=None,  # noqa: A002
                      input_split_sizes=None, group: ProcessGroup | None = None,
                      async_op: bool = False):
    """``input`` split on dim 0 (``input_split_sizes``, default equal); piece j goes to
    member j, and the result concatenates the pieces received from members 0..n-1.

    With uneven sizes the received pieces are ``output_split_sizes`` rows each (default:
    ``output``'s dim 0 split equally; without ``output``, pass the sizes).
    """
    check_kept(output, "all_to_all_single", "output")
    g = eng.member_group(group, "all_to_all_single")
    if g is None:
        return None
    x, as_jax = _prep(input, "all_to_all_single")
    n = g.size()
    if x.ndim == 0:
        raise ValueError("jdist.all_to_all_single: input must have a dim 0 to split, got a "
                         "0-d array")
    send = _splits(input_split_sizes, x.shape[0], n, "input")
    if output is None and output_split_sizes is None:
        recv = send if input_split_sizes is None else None
        if recv is None:
            raise ValueError("jdist.all_to_all_single: with input_split_sizes and no output "
                             "array, pass output_split_sizes (the rows each member sends "
                             "here)")
    else:
        rows = sum(output_split_sizes) if output is None else np.shape(output)[0]
        recv = _splits(output_split_sizes, rows, n, "output")
    rest = tuple(x.shape[1:])
    if len(set(send)) == 1 and send == recv:
        stacked = x.reshape((n, send[0], *rest))

        def fn():
            fp = _fp(g, "all_to_all", None, stacked.shape, stacked.dtype)
            out = _exchange(g, "all_to_all_single", stacked, as_jax, fp).reshape(x.shape)
            if output is not None:
                _write_back(output, out)
            return out

        return dispatch(g, "all_to_all_single", fn, async_op)
    offsets = np.concatenate([[0], np.cumsum(send)]).astype(int)
    pieces = [x[offsets[j]:offsets[j + 1]] for j in range(n)]
    receive = [(r, *rest) for r in recv]
    xnp = jax.numpy if as_jax else np

    def fn_uneven():
        got = _exchange_uneven(g, "all_to_all_single", pieces, receive, x.dtype, as_jax)
        out = xnp.concatenate(got, axis=0)
        if output is not None:
            _write_back(output, out)
        return out

    return dispatch(g, "all_to_all_single", fn_uneven, async_op)
