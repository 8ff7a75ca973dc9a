"""Work over a tree of leaves runs one program per tree, not one per leaf shape.

A per-leaf eager op (``jnp.copy(x)``, ``x[0]``, ``jnp.asarray(host)``) compiles a
program for every new shape: a model of k distinct shapes paid k lowerings and compiles
at DDP's init and first step. The copies before a donated step (``jdist/_donation.py``),
the first replica's rows (``local_first``) and host values placed per replica
(``per_replica``) now lower at most one program per placement, and the all-gather of
byte strings one per power of two of their length. Generated trees of distinct shapes;
values checked against numpy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import monitoring

from jdist._donation import Donation
from jdist.collectives._group import ProcessGroup, make_mesh
from jdist.ddp._placement import local_first, per_replica
from jdist.ddp._sync import gather_bytes

_LOWERED: list[str] = []
monitoring.register_event_duration_secs_listener(
    lambda event, _secs, **_kw: _LOWERED.append(event)
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration" else None)


def _lowerings(fn, *args):
    before = len(_LOWERED)
    out = fn(*args)
    jax.block_until_ready(jax.tree.leaves(out))
    return out, len(_LOWERED) - before


def _group(n):
    devs = tuple(jax.devices()[:n])
    return ProcessGroup(ranks=(0,), rank=0, mesh=make_mesh(devs, "dp"), axis_name="dp",
                        backend="local", devices_per_rank=(devs,), name=f"FEW{n}")


# shapes no other test uses (a fresh program each example), distinct within a tree
_shapes = st.lists(st.tuples(st.integers(101, 140), st.integers(1, 3)), min_size=2,
                   max_size=6, unique=True)


@settings(max_examples=8, deadline=None)
@given(shapes=_shapes, n=st.sampled_from([2, 4]), seed=st.integers(0, 2**16))
def test_per_replica_then_local_first_lower_at_most_one_program(shapes, n, seed):
    rng = np.random.default_rng(seed)
    host = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    placed, k = _lowerings(per_replica, host, _group(n))
    assert k == 0, "host values placed per replica need no program"
    for x, h in zip(placed, host, strict=True):
        assert x.shape == (n, *h.shape)
        np.testing.assert_array_equal(np.asarray(x), np.broadcast_to(h, x.shape))
    first, k = _lowerings(local_first, placed)
    assert k <= 1, f"{k} programs for {len(shapes)} leaves"
    for x, h in zip(first, host, strict=True):
        np.testing.assert_array_equal(np.asarray(x), h)


@settings(max_examples=8, deadline=None)
@given(shapes=_shapes, seed=st.integers(0, 2**16))
def test_copies_before_a_donated_step_lower_one_program(shapes, seed):
    rng = np.random.default_rng(seed)
    host = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    mine = [jnp.asarray(h) for h in host]
    out, k = _lowerings(lambda: Donation().own(mine, mine, set()))
    assert k <= 1, f"{k} programs for {len(shapes)} leaves"
    for x, y, h in zip(mine, out, host, strict=True):
        assert y is not x and y.sharding == x.sharding
        np.testing.assert_array_equal(np.asarray(y), h)
        y.delete()  # a copy: the user's array survives it
        np.testing.assert_array_equal(np.asarray(x), h)


@settings(max_examples=6, deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), min_size=2, max_size=4))
def test_gathered_bytes_of_any_length_come_back_and_share_programs(sizes):
    """Model descriptions of similar length (the same power of two) share one gather."""
    group = _group(2)
    for size in sizes:
        data = bytes(np.random.default_rng(size).integers(0, 256, size, np.uint8))
        got, k = _lowerings(gather_bytes, group, data)
        assert got == [data]  # one process: its own bytes
        again, k = _lowerings(gather_bytes, group, data[:len(data) // 2 + 1])
        assert k == 0 or (len(data) // 2 + 1 - 1).bit_length() != (len(data) - 1) \
            .bit_length(), "a shorter description of the same size class recompiled"
        assert again == [data[:len(data) // 2 + 1]]
