"""A rank that is alive but stuck (a long host computation, a deadlock in user code)
is named by every other rank, on each path that waits for it: an eager collective, a
DDP step and an RPC (issue 41's fault tests). Three processes, so that two survivors
must each name the same rank.
"""

from __future__ import annotations

import time

import pytest

from tests.helpers import run_procs

TIMEOUT = 2  # seconds: the group timeout / RPC timeout
STUCK = 2  # the rank that gets stuck
_STALL_S = TIMEOUT + 3  # how long it stays stuck (past every survivor's timeout)


def _stall(x):
    time.sleep(_STALL_S)
    return x


def _eager_or_ddp(path: str) -> dict:
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import jdist
    from jdist.ddp import DistributedDataParallel

    jdist.init_process_group(timeout=TIMEOUT)
    rank = jdist.get_rank()
    if path == "eager":
        def step():
            return jdist.all_reduce(np.ones(3, np.float32))
    else:
        model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        ddp = DistributedDataParallel(model)
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        train = ddp.train_step(lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2), opt)
        batch = {"x": np.ones((4, 3), np.float32), "y": np.zeros((4, 2), np.float32)}

        def step():
            return np.asarray(train(batch))
    step()
    step()  # connections made, programs compiled: the next call can only wait for peers
    if rank == STUCK:
        time.sleep(_STALL_S)
        return {}
    t = time.monotonic()
    try:
        step()
        return {"error": "none", "took": time.monotonic() - t}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "took": time.monotonic() - t}


def _rpc() -> dict:
    import os

    import jdist.rpc as rpc

    rank = int(os.environ["RANK"])
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=3,
                 rpc_backend_options=rpc.RpcBackendOptions(rpc_timeout=TIMEOUT))
    out = {}
    if rank != STUCK:
        assert rpc.rpc_sync(f"w{STUCK}", sum, ([1, 2],)) == 3
        t = time.monotonic()
        try:
            rpc.rpc_sync(f"w{STUCK}", _stall, (1,))
            out = {"error": "none", "took": time.monotonic() - t}
        except Exception as exc:
            out = {"error": f"{type(exc).__name__}: {exc}", "took": time.monotonic() - t}
    rpc.shutdown()
    return out


EXPECTED = {
    "eager": ("CollectiveTimeoutError", f"rank {STUCK} is still at collective #"),
    "ddp": ("CollectiveTimeoutError", f"rank {STUCK} is still at step #2 (DDP step #2)"),
    "rpc": ("RpcTimeoutError", f"name=w{STUCK}"),
}


@pytest.mark.parametrize("path", ["eager", "ddp", "rpc"])
def test_every_survivor_names_the_stuck_rank(path):
    if path == "rpc":
        results = run_procs(_rpc, 3, timeout=120)
    else:
        results = run_procs(_eager_or_ddp, 3, args=(path,), timeout=120)
    kind, names = EXPECTED[path]
    for rank, res in enumerate(results):
        if rank == STUCK:
            continue
        assert res["error"].startswith(kind) and names in res["error"], (rank, res)
        assert TIMEOUT - 0.5 <= res["took"] < TIMEOUT + 3, (rank, res)
