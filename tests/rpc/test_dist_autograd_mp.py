"""examples/rpc_parameter_server.py in 3 real processes (TCP): both trainers learn.

The trainers' forward passes are differentiable RPCs to the server's RRef (through the
RRef proxy), the gradients wait in the contexts on the server and each trainer's
DistributedOptimizer applies them there.
"""

from __future__ import annotations

from tests.helpers import run_procs


def _rank_main(argv):
    from examples.rpc_parameter_server import main

    return main(argv)


def test_parameter_server_example_learns():
    out = run_procs(_rank_main, 3, args=(["--smoke"],), timeout=240)[0]
    for who in ("trainer1", "trainer2"):
        res = out[who]
        assert len(res["losses"]) == 30
        assert res["acc_before"] < 0.5 < res["acc_after"], res
        assert sum(res["losses"][-5:]) < 0.7 * sum(res["losses"][:5]), res["losses"]


# ---- a worker process killed in the middle of the backward pass (TCP, real processes) ----
def _options():
    from jdist.rpc import RpcBackendOptions

    return RpcBackendOptions(rpc_timeout=60, shutdown_timeout=30)


def _leaf_dies_in_backward(a):
    import os

    import jax

    @jax.custom_vjp
    def f(x):
        return x * 3.0

    def fwd(x):
        return x * 3.0, None

    def bwd(_, ct):
        os._exit(7)  # the process dies while its peers wait for this backward

    f.defvjp(fwd, bwd)
    return f(a)


def _mid(x):
    import jax.numpy as jnp

    from jdist.rpc import rpc_sync

    return rpc_sync("leaf", _leaf_dies_in_backward, (jnp.sin(x),))


def leaf_main():
    """The leaf worker, run as a child of rank 2's process (so its death is no failure)."""
    import time

    from jdist.rpc import init_rpc

    init_rpc("leaf", rank=2, world_size=3, rpc_backend_options=_options())
    time.sleep(90)  # killed by its own backward rule long before


def _death_rank():
    import os
    import subprocess
    import sys
    import time

    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jdist.errors import WorkerUnavailableError
    from jdist.rpc import RRef, dist_autograd, init_rpc, rpc_sync, shutdown

    rank = int(os.environ["RANK"])
    if rank == 2:
        child = subprocess.run([sys.executable, "-c", "from tests.rpc.test_dist_autograd_mp "
                                "import leaf_main; leaf_main()"], timeout=120)
        return {"leaf_returncode": child.returncode}
    init_rpc("root" if rank == 0 else "mid", rank=rank, world_size=3,
             rpc_backend_options=_options())
    out = {}
    if rank == 0:
        w = RRef(nnx.Param(jnp.asarray(np.arange(3.0, dtype=np.float32))))
        t0 = time.monotonic()
        try:
            with dist_autograd.context() as cid:
                dist_autograd.backward(
                    cid, lambda r: jnp.sum(rpc_sync("mid", _mid, (r.local_value()[...],))), w)
        except WorkerUnavailableError as e:
            out["error"] = (type(e).__name__, str(e), time.monotonic() - t0)
    shutdown(graceful=True, timeout=30)
    return out


def test_worker_killed_mid_backward_fails_the_root_with_a_named_error():
    root, mid, leaf = run_procs(_death_rank, 3, timeout=150)
    assert leaf["leaf_returncode"] == 7
    name, msg, took = root["error"]
    assert name == "WorkerUnavailableError"
    assert "WorkerInfo(id=2, name=leaf)" in msg and "_callee_backward" in msg, msg
    assert took < 30
