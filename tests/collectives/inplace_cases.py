"""Worker of tests/collectives/test_inplace.py: every collective torch runs in place,
called as a statement (torch's idiom) with a jax output, refused on every rank before
anything is sent; the same call with its result used, and with a numpy output (filled
in place), gives the reduced values."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import jdist
from jdist.errors import ImmutableTargetError

N = 4


# torch's idiom, one statement each (the call's value is popped)
def st_all_reduce(x):
    jdist.all_reduce(x)


def st_broadcast(x):
    jdist.broadcast(x, src=0)


def st_reduce(x):
    jdist.reduce(x, dst=0)


def st_scatter(x):
    jdist.scatter(x, [jnp.full(N, i, jnp.float32) for i in range(2)]
                  if jdist.get_rank() == 0 else None, src=0)


def st_all_gather_into_tensor(x):
    jdist.all_gather_into_tensor(x, jnp.ones(N // 2, jnp.float32))


def st_reduce_scatter_tensor(x):
    jdist.reduce_scatter_tensor(x, jnp.ones(2 * N, jnp.float32))


def st_all_to_all_single(x):
    jdist.all_to_all_single(x, jnp.ones(N, jnp.float32))


def st_recv(x):
    jdist.recv(x, src=0)


STATEMENTS = [st_all_reduce, st_broadcast, st_reduce, st_scatter, st_all_gather_into_tensor,
              st_reduce_scatter_tensor, st_all_to_all_single]


def used(name, x):
    """The same calls, their results used: ``(result, expected)``."""
    r = jdist.get_rank()
    if name == "st_all_reduce":
        return jdist.all_reduce(x), np.full(N, 2.0)
    if name == "st_broadcast":
        return jdist.broadcast(x * (r + 1), src=0), np.ones(N)
    if name == "st_reduce":
        out = jdist.reduce(x, dst=0)
        return out, np.full(N, 2.0) if r == 0 else np.ones(N)
    if name == "st_scatter":
        return jdist.scatter(x, [jnp.full(N, i, jnp.float32) for i in range(2)]
                             if r == 0 else None, src=0), np.full(N, float(r))
    if name == "st_all_gather_into_tensor":
        return jdist.all_gather_into_tensor(x, jnp.ones(N // 2, jnp.float32)), np.ones(N)
    if name == "st_reduce_scatter_tensor":
        return jdist.reduce_scatter_tensor(x, jnp.ones(2 * N, jnp.float32)), np.full(N, 2.0)
    return jdist.all_to_all_single(x, jnp.ones(N, jnp.float32)), np.ones(N)


def statement_calls() -> dict:
    jdist.init_process_group()
    r = jdist.get_rank()
    out = {"refused": [], "used": [], "numpy": None}
    for st in STATEMENTS:
        try:
            st(jnp.ones(N, jnp.float32))
        except ImmutableTargetError as e:
            out["refused"].append((st.__name__, type(e).__mro__[1].__name__, str(e)))
        got, want = used(st.__name__, jnp.ones(N, jnp.float32))
        out["used"].append((st.__name__, np.asarray(got).tolist(), want.tolist()))
    buf = np.ones(N, np.float32)
    st_all_reduce(buf)  # numpy: updated in place, as in torch
    out["numpy"] = buf.tolist()
    if r == 0:
        jdist.send(np.arange(N, dtype=np.float32), dst=1)
    else:
        try:
            st_recv(jnp.zeros(N, jnp.float32))
        except ImmutableTargetError as e:
            out["refused"].append(("st_recv", "", str(e)))
        sender, got = jdist.recv(jnp.zeros(N, jnp.float32), src=0)
        out["recv"] = (sender, np.asarray(got).tolist())
    jdist.barrier()
    jdist.destroy_process_group()
    return out
