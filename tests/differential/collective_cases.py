"""One generated collective case, run on every rank of a torch (gloo) or a jdist pool.

The same code drives both libraries through ``_Lib``: inputs are built from the case's
seed and the rank (integer-valued, so every dtype's sums and products are exact and the
results compare bit for bit), the collective is called with torch's signature, and what
torch writes in place is read back from the same tensors (jdist fills writable numpy
arrays in place, which is part of what is compared). A rank returns
``("ok", {name: array})`` or ``("raised", class names of the exception's MRO,
message)``.
"""

from __future__ import annotations

import numpy as np

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32",
          "int64", "bool", "complex64", "complex128"]
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"]
KINDS = ["all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
         "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
         "all_to_all_single", "p2p", "objects"]

_groups: dict = {}


class _Lib:
    """torch.distributed or jdist behind one small interface (arrays in, arrays out)."""

    def __init__(self, name: str):
        self.name = name
        if name == "torch":
            import torch
            import torch.distributed as dist

            self.torch, self.dist = torch, dist
        else:
            import jdist

            self.dist = jdist

    def tensor(self, a: np.ndarray, dtype: str):
        if self.name == "torch":
            t = self.torch.from_numpy(np.array(a.astype(
                "float32" if dtype == "bfloat16" else dtype)))
            return t.to(self.torch.bfloat16) if dtype == "bfloat16" else t
        if dtype == "bfloat16":
            import ml_dtypes

            return np.array(a.astype(ml_dtypes.bfloat16), order="C")
        return np.array(a.astype(dtype), order="C")

    def numpy(self, t) -> np.ndarray:
        if self.name == "torch":
            if t.dtype == self.torch.bfloat16:
                t = t.float()
            return t.numpy().copy()
        a = np.asarray(t)
        return a.astype(np.float32) if a.dtype.name == "bfloat16" else a.copy()

    def group(self, ranks: tuple):
        world = self.dist.get_world_size()
        if tuple(ranks) == tuple(range(world)):
            return None
        key = (self.name, tuple(ranks))
        if key not in _groups:  # every rank creates every group, in the same order
            _groups[key] = self.dist.new_group(list(ranks))
        return _groups[key]


def values(case: dict, rank: int, shape: tuple, salt: int = 0) -> np.ndarray:
    """Integer values (small: exact in every dtype, products included)."""
    rng = np.random.default_rng([case["seed"], rank, salt])
    dtype = case["dtype"]
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    lo = 0 if dtype == "uint8" else -3
    a = rng.integers(lo, 4, shape)
    if dtype.startswith("complex"):
        a = a + 1j * rng.integers(-3, 4, shape)
    return a


def run(lib_name: str, case: dict):
    lib = _Lib(lib_name)
    dist = lib.dist
    group = lib.group(tuple(case["ranks"]))  # every rank, members or not
    ranks = tuple(sorted(case["ranks"]))  # a group's ranks are in global order (torch)
    rank = dist.get_rank()
    if rank not in ranks:
        return ("ok", {})
    try:
        return ("ok", _KIND[case["kind"]](lib, case, group, ranks, ranks.index(rank)))
    except Exception as e:  # noqa: BLE001 - compared with the other library's outcome
        return ("raised", [c.__name__ for c in type(e).__mro__], str(e)[:300])


def _wait(work, case):
    if case["async_op"] and work is not None:
        work.wait()


def _op(lib, case):
    return getattr(lib.dist.ReduceOp, case["op"])


def _shape(case):
    return tuple(case["shape"])


def _all_reduce(lib, case, group, ranks, me):
    t = lib.tensor(values(case, ranks[me], _shape(case)), case["dtype"])
    _wait(lib.dist.all_reduce(t, _op(lib, case), group=group, async_op=case["async_op"]), case)
    return {"out": lib.numpy(t)}


def _reduce(lib, case, group, ranks, me):
    t = lib.tensor(values(case, ranks[me], _shape(case)), case["dtype"])
    root = ranks[case["root"] % len(ranks)]
    _wait(lib.dist.reduce(t, root, _op(lib, case), group=group, async_op=case["async_op"]),
          case)
    return {"out": lib.numpy(t)} if ranks[me] == root else {}


def _broadcast(lib, case, group, ranks, me):
    t = lib.tensor(values(case, ranks[me], _shape(case)), case["dtype"])
    root = ranks[case["root"] % len(ranks)]
    _wait(lib.dist.broadcast(t, root, group=group, async_op=case["async_op"]), case)
    return {"out": lib.numpy(t)}


def _empty_like_values(lib, case, shape):
    return lib.tensor(np.zeros(shape), case["dtype"])


def _all_gather(lib, case, group, ranks, me):
    t = lib.tensor(values(case, ranks[me], _shape(case)), case["dtype"])
    outs = [_empty_like_values(lib, case, _shape(case)) for _ in ranks]
    _wait(lib.dist.all_gather(outs, t, group=group, async_op=case["async_op"]), case)
    return {f"out{i}": lib.numpy(o) for i, o in enumerate(outs)}


def _all_gather_into_tensor(lib, case, group, ranks, me):
    shape = _shape(case) or (1,)
    t = lib.tensor(values(case, ranks[me], shape), case["dtype"])
    out = _empty_like_values(lib, case, (shape[0] * len(ranks), *shape[1:]))
    _wait(lib.dist.all_gather_into_tensor(out, t, group=group, async_op=case["async_op"]),
          case)
    return {"out": lib.numpy(out)}


def _gather(lib, case, group, ranks, me):
    t = lib.tensor(values(case, ranks[me], _shape(case)), case["dtype"])
    root = ranks[case["root"] % len(ranks)]
    outs = [_empty_like_values(lib, case, _shape(case)) for _ in ranks] \
        if ranks[me] == root else None
    _wait(lib.dist.gather(t, outs, root, group=group, async_op=case["async_op"]), case)
    return {f"out{i}": lib.numpy(o) for i, o in enumerate(outs or [])}


def _scatter(lib, case, group, ranks, me):
    root = ranks[case["root"] % len(ranks)]
    t = _empty_like_values(lib, case, _shape(case))
    ins = [lib.tensor(values(case, ranks[me], _shape(case), salt=i), case["dtype"])
           for i in range(len(ranks))] if ranks[me] == root else None
    _wait(lib.dist.scatter(t, ins, root, group=group, async_op=case["async_op"]), case)
    return {"out": lib.numpy(t)}


def _reduce_scatter(lib, case, group, ranks, me):
    ins = [lib.tensor(values(case, ranks[me], _shape(case), salt=i), case["dtype"])
           for i in range(len(ranks))]
    out = _empty_like_values(lib, case, _shape(case))
    _wait(lib.dist.reduce_scatter(out, ins, _op(lib, case), group=group,
                                  async_op=case["async_op"]), case)
    return {"out": lib.numpy(out)}


def _reduce_scatter_tensor(lib, case, group, ranks, me):
    shape = _shape(case) or (1,)
    big = (shape[0] * len(ranks), *shape[1:])
    t = lib.tensor(values(case, ranks[me], big), case["dtype"])
    out = _empty_like_values(lib, case, shape)
    _wait(lib.dist.reduce_scatter_tensor(out, t, _op(lib, case), group=group,
                                         async_op=case["async_op"]), case)
    return {"out": lib.numpy(out)}


def _all_to_all(lib, case, group, ranks, me):
    ins = [lib.tensor(values(case, ranks[me], _shape(case), salt=i), case["dtype"])
           for i in range(len(ranks))]
    outs = [_empty_like_values(lib, case, _shape(case)) for _ in ranks]
    _wait(lib.dist.all_to_all(outs, ins, group=group, async_op=case["async_op"]), case)
    return {f"out{i}": lib.numpy(o) for i, o in enumerate(outs)}


def _all_to_all_single(lib, case, group, ranks, me):
    shape = _shape(case) or (1,)
    big = (shape[0] * len(ranks), *shape[1:])
    t = lib.tensor(values(case, ranks[me], big), case["dtype"])
    out = _empty_like_values(lib, case, big)
    _wait(lib.dist.all_to_all_single(out, t, group=group, async_op=case["async_op"]), case)
    return {"out": lib.numpy(out)}


def _p2p(lib, case, group, ranks, me):
    """Each member sends to the member ``shift`` places on and receives from the one
    ``shift`` places back (isend/irecv, or batch_isend_irecv)."""
    n = len(ranks)
    shift = 1 + case["root"] % max(n - 1, 1)
    to, frm = ranks[(me + shift) % n], ranks[(me - shift) % n]
    out = _empty_like_values(lib, case, _shape(case))
    if n == 1:
        return {}
    t = lib.tensor(values(case, ranks[me], _shape(case)), case["dtype"])
    d = lib.dist
    if case["async_op"]:
        ops = [d.P2POp(d.isend, t, to, group=group), d.P2POp(d.irecv, out, frm, group=group)]
        for w in d.batch_isend_irecv(ops):
            w.wait()
    else:
        works = [d.isend(t, to, group=group), d.irecv(out, frm, group=group)]
        for w in works:
            w.wait()
    return {"out": lib.numpy(out)}


def _objects(lib, case, group, ranks, me):
    rng = np.random.default_rng([case["seed"], ranks[me]])
    mine = {"rank": ranks[me], "items": [int(x) for x in rng.integers(0, 9, rng.integers(0, 4))],
            "name": "r" * int(rng.integers(0, 5))}
    d, root = lib.dist, ranks[case["root"] % len(ranks)]
    gathered = [None] * len(ranks)
    d.all_gather_object(gathered, mine, group=group)
    box = [mine if ranks[me] == root else None]
    d.broadcast_object_list(box, src=root, group=group)
    got = [None] * len(ranks) if ranks[me] == root else None
    d.gather_object(mine, got, dst=root, group=group)
    out = [None]
    d.scatter_object_list(out, [{"to": r} for r in ranks] if ranks[me] == root else None,
                          src=root, group=group)
    return {"objects": repr((gathered, box, got, out))}


_KIND = {"all_reduce": _all_reduce, "reduce": _reduce, "broadcast": _broadcast,
         "all_gather": _all_gather, "all_gather_into_tensor": _all_gather_into_tensor,
         "gather": _gather, "scatter": _scatter, "reduce_scatter": _reduce_scatter,
         "reduce_scatter_tensor": _reduce_scatter_tensor, "all_to_all": _all_to_all,
         "all_to_all_single": _all_to_all_single, "p2p": _p2p, "objects": _objects}
