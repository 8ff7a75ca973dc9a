"""Gradients of the in-graph collectives, under check_vma=True and False.

The loss is ``sum_r <w_r, out_r>`` over every replica's output (outputs leave
``shard_map`` stacked, the sum is taken outside). Its gradient is compared with the
gradient of the same global function written in plain ``jnp`` on the stacked
``(N, ...)`` array, with no collectives (an independent, analytic reference), and for
PRODUCT and broadcast also with central finite differences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jdist.collectives import ReduceOp
from jdist.collectives import functional as F

N = 8
X = (np.random.RandomState(0).uniform(0.5, 1.5, (N, 16, 2))
     * np.random.RandomState(1).choice([-1, 1], (N, 16, 2))).astype(np.float32)
X[2, 0, 0] = 0.0  # PRODUCT's gradient must stay right through an exact zero


def chunk(a, r):
    return a[2 * r:2 * r + 2]


# name -> (per-replica collective, global reference: (N, ...) array -> per-replica outputs)
CASES = {
    "all_reduce_sum": (lambda v: F.all_reduce(v),
                       lambda g: jnp.broadcast_to(g.sum(0), g.shape)),
    "all_reduce_avg": (lambda v: F.all_reduce(v, ReduceOp.AVG),
                       lambda g: jnp.broadcast_to(g.mean(0), g.shape)),
    "all_reduce_max": (lambda v: F.all_reduce(v, ReduceOp.MAX),
                       lambda g: jnp.broadcast_to(g.max(0), g.shape)),
    "all_reduce_min": (lambda v: F.all_reduce(v, ReduceOp.MIN),
                       lambda g: jnp.broadcast_to(g.min(0), g.shape)),
    "all_reduce_product": (lambda v: F.all_reduce(v, ReduceOp.PRODUCT),
                           lambda g: jnp.broadcast_to(g.prod(0), g.shape)),
    "broadcast": (lambda v: F.broadcast(v, 3),
                  lambda g: jnp.broadcast_to(g[3], g.shape)),
    "reduce": (lambda v: F.reduce(v, 6, ReduceOp.SUM),
               lambda g: g.at[6].set(g.sum(0))),
    "all_gather": (lambda v: F.all_gather(v, axis=1),
                   lambda g: jnp.broadcast_to(jnp.stack(list(g), 1), (N, 16, N, 2))),
    "scatter": (lambda v: F.scatter(v, 5),
                lambda g: jnp.stack([chunk(g[5], r) for r in range(N)])),
    "reduce_scatter_sum": (lambda v: F.reduce_scatter(v),
                           lambda g: jnp.stack([chunk(g.sum(0), r) for r in range(N)])),
    "reduce_scatter_avg": (lambda v: F.reduce_scatter(v, ReduceOp.AVG),
                           lambda g: jnp.stack([chunk(g.mean(0), r) for r in range(N)])),
    "all_to_all": (lambda v: F.all_to_all(v),
                   lambda g: jnp.stack([jnp.concatenate([chunk(g[j], r) for j in range(N)])
                                        for r in range(N)])),
    "send_recv": (lambda v: F.send_recv(v, 3),
                  lambda g: jnp.stack([g[(r - 3) % N] for r in range(N)])),
    "ring_all_reduce": (lambda v: F.ring_all_reduce(v),
                        lambda g: jnp.broadcast_to(g.sum(0), g.shape)),
}


def weights(shape):
    return jnp.asarray(np.random.RandomState(7).randn(*shape).astype(np.float32))


def sharded_loss(fn, mesh, check_vma):
    def body(b):
        return fn(b[0])[None]

    f = jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"),
                      check_vma=check_vma)

    def loss(x, w):
        return jnp.sum(w * jnp.sin(f(x)))

    return jax.jit(loss)


@pytest.mark.parametrize("check_vma", [True, False])
def test_gradients_match_plain_jnp_reference(mesh8, check_vma):
    """All cases in one compiled program per mode; each case has its own weights and
    its own gradient, so a failure names the case."""
    x = jnp.asarray(X)
    names = list(CASES)
    shapes = {k: jax.eval_shape(CASES[k][1], x).shape for k in names}
    ws = {k: weights(shapes[k]) for k in names}

    def grads_of_each_case(x):
        out = {}
        for k in names:
            f = jax.shard_map(lambda b, k=k: CASES[k][0](b[0])[None], mesh=mesh8,
                              in_specs=P("dp"), out_specs=P("dp"), check_vma=check_vma)
            out[k] = jax.grad(lambda x, k=k, f=f: jnp.sum(ws[k] * jnp.sin(f(x))))(x)
        return out

    def reference_grads(x):
        return {k: jax.grad(lambda g, k=k: jnp.sum(ws[k] * jnp.sin(CASES[k][1](g))))(x)
                for k in names}

    grads = jax.jit(grads_of_each_case)(x)
    refs = jax.jit(reference_grads)(x)
    for k in names:
        np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(refs[k]), rtol=2e-4,
                                   atol=2e-5, err_msg=f"{k}, check_vma={check_vma}")

@pytest.mark.parametrize("check_vma", [True, False])
def test_product_and_broadcast_gradients_match_finite_differences(mesh8, check_vma):
    x = jnp.asarray(X[:, :8, 0])  # (N, 8)
    for name, fn in [("product", lambda v: F.all_reduce(v, ReduceOp.PRODUCT)),
                     ("broadcast", lambda v: F.broadcast(v, 2))]:
        w = weights((N, 8))
        loss = sharded_loss(fn, mesh8, check_vma)
        g = np.asarray(jax.grad(loss)(x, w))
        xn = np.asarray(x, np.float32)
        eps = 1e-2
        for idx in [(2, 0), (2, 3), (0, 1), (5, 7), (7, 0)]:
            plus, minus = xn.copy(), xn.copy()
            plus[idx] += eps
            minus[idx] -= eps
            fd = (float(loss(plus, w)) - float(loss(minus, w))) / (2 * eps)
            np.testing.assert_allclose(g[idx], fd, rtol=2e-2, atol=2e-3,
                                       err_msg=f"{name} {idx} check_vma={check_vma}")


def test_loss_inside_shard_map_on_invariant_results(mesh8):
    """check_vma=True: a scalar loss built from invariant results leaves with P()."""
    x = jnp.asarray(X[:, :4, 0])

    def body(b):
        v = b[0]
        s = F.all_reduce(v)
        p = F.all_reduce(v, ReduceOp.PRODUCT)
        c = F.broadcast(v, 1)
        g = F.all_gather(v)
        return jnp.sum(s ** 2) + jnp.sum(p) + jnp.sum(jnp.cos(c)) + jnp.sum(g ** 3)

    f = jax.shard_map(body, mesh=mesh8, in_specs=P("dp"), out_specs=P(), check_vma=True)

    def ref(g):
        return (jnp.sum(g.sum(0) ** 2) + jnp.sum(g.prod(0)) + jnp.sum(jnp.cos(g[1]))
                + jnp.sum(g ** 3))

    np.testing.assert_allclose(float(jax.jit(f)(x)), float(ref(x)), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(f))(x)), np.asarray(jax.grad(ref)(x)),
                               rtol=1e-4, atol=1e-5)
