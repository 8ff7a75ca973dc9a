"""torch's comm-hook checks across 2 real processes (one device each), as torch runs
them: one shared launch runs every case and returns their results.

- ``get_future``: torch's expected value with ``len(group) == 2``;
- a hook whose result is equal on every replica but typed per-replica (the mean of a
  plain ``jax.lax.all_gather``) gives the plain DDP gradients;
- a hook leaving each process its own gradient (torch's noop) raises
  ReplicaDivergenceError on every process instead of hanging or drifting.
"""

from __future__ import annotations

import numpy as np

from tests.helpers import run_procs

WORLD = 2


def _get_future():
    import jdist

    inp = np.full((3, 3, 3), 2.0, np.float32)  # torch's _build_tensor(3, 2)
    value = jdist.all_reduce(inp, async_op=True).get_future().result(timeout=60)
    return [t + 1 for t in [t * 3 for t in [value]]][0]


def _grads(hook):
    import jax.numpy as jnp
    from flax import nnx

    import jdist
    from jdist.ddp import DistributedDataParallel as DDP

    rank = jdist.get_rank()
    ddp = DDP(nnx.Linear(1, 5, rngs=nnx.Rngs(0)))
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    x = np.full((1, 1), float(rank), np.float32)  # torch's batch = [rank]
    _, grads = ddp.value_and_grad(lambda m, b: jnp.sum(m(b)))(x)
    return np.asarray(grads["kernel"])


def gather_mean_hook(state, bucket):
    import jax
    import jax.numpy as jnp

    return jnp.mean(jax.lax.all_gather(bucket.buffer, bucket.axis_name), axis=0), state


def noop_hook(state, bucket):
    return bucket.buffer, state


def _noop_raises():
    from jdist.errors import ReplicaDivergenceError

    try:
        _grads(noop_hook)
    except ReplicaDivergenceError as exc:
        return f"ReplicaDivergenceError: {exc}"
    return "no error"


def hooks_child():
    import jdist

    jdist.init_process_group(timeout=60)
    try:
        return {"get_future": _get_future(),
                "plain": _grads(None),
                "gather_mean": _grads(gather_mean_hook),
                "noop": _noop_raises()}
    finally:
        jdist.destroy_process_group()


def test_comm_hooks_two_processes():
    res = run_procs(hooks_child, WORLD, timeout=240)
    for r in res:
        np.testing.assert_array_equal(r["get_future"], np.full((3, 3, 3), 2 * WORLD * 3 + 1))
        assert r["plain"][0, 0] == sum(range(WORLD)) / WORLD  # torch's expected_grad
        np.testing.assert_allclose(r["gather_mean"], r["plain"], rtol=1e-6)
        assert "ReplicaDivergenceError" in r["noop"] and "differs across replicas" in r["noop"]
