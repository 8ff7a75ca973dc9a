"""A rank that is alive but stuck (a long host computation, a deadlock in user code)
is named by every other rank, on each path that waits for it: an eager collective, a
DDP step and an RPC (issue 41's fault tests). Three processes, so that two survivors
must each name the same rank. The collective paths also show the stuck rank's main
thread stack (published by its heartbeat, ``jdist/collectives/_watchdog.py``), even
when that rank was stopped with ``SIGSTOP`` and cannot answer (issue 44).
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


def _eager_or_ddp(path: str, pid_file: str = "") -> dict:
    import os
    import signal

    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import jdist
    from jdist.ddp import DistributedDataParallel

    jdist.init_process_group(timeout=TIMEOUT)
    rank = jdist.get_rank()
    if path.startswith("eager"):
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
    if rank == STUCK and path == "eager-stopped":
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(1.5)  # (a heartbeat publishes this line's stack)
        os.kill(os.getpid(), signal.SIGSTOP)
        return {}
    if rank == STUCK:
        time.sleep(_STALL_S)
        return {}
    t = time.monotonic()
    try:
        step()
        out = {"error": "none", "took": time.monotonic() - t}
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {exc}", "took": time.monotonic() - t}
    if path == "eager-stopped":
        time.sleep(0.5)  # (both survivors have read its state)
        with open(pid_file) as f:
            os.kill(int(f.read()), signal.SIGCONT)
    return out


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


STACK = "in _eager_or_ddp\n        time.sleep("
EXPECTED = {
    "eager": ("CollectiveTimeoutError", f"rank {STUCK} is still at collective #", STACK),
    "eager-stopped": ("CollectiveTimeoutError", f"rank {STUCK} is still at collective #",
                      STACK),
    "ddp": ("CollectiveTimeoutError", f"rank {STUCK} is still at step #2 (DDP step #2)",
            STACK),
    "rpc": ("RpcTimeoutError", f"name=w{STUCK}", ""),
}


@pytest.mark.parametrize("path", ["eager", "eager-stopped", "ddp", "rpc"])
def test_every_survivor_names_the_stuck_rank(path, tmp_path):
    if path == "rpc":
        results = run_procs(_rpc, 3, timeout=120)
    else:
        results = run_procs(_eager_or_ddp, 3, args=(path, str(tmp_path / "pid")), timeout=120)
    kind, names, stack = EXPECTED[path]
    for rank, res in enumerate(results):
        if rank == STUCK:
            continue
        assert res["error"].startswith(kind) and names in res["error"], (rank, res)
        assert stack in res["error"], (rank, res)
        assert ("its process is stopped" in res["error"]) == (path == "eager-stopped"), res
        assert TIMEOUT - 0.5 <= res["took"] < 2 * TIMEOUT + 1, (rank, res)
