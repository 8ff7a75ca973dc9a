"""comm_report: collectives read from lowered/compiled HLO, checked on known programs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from jdist.collectives._group import make_mesh
from jdist.ddp.hooks import comm_report
from jdist.ddp.hooks._report import parse_hlo_collectives

N = 8


def _smap(body, n_in=1):
    mesh = make_mesh(jax.devices()[:N], "dp")
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("dp"),) * n_in,
                                 out_specs=P("dp"), check_vma=False))


def test_ops_dtypes_elements_bytes_branches_and_loops():
    def body(x, it):
        x = x[0]  # local (16,) f32
        a = jax.lax.psum_scatter(x, "dp", tiled=True)  # 16 in, 2 out
        b = jax.lax.all_gather(a.astype(jnp.bfloat16), "dp", tiled=True)  # 2 in, 16 out
        c = jax.lax.cond(it[0, 0] > 0, lambda v: jax.lax.psum(v, "dp"),
                         lambda v: jax.lax.psum(v[:4].astype(jnp.float16), "dp").sum() + v,
                         x)
        d = jax.lax.fori_loop(0, 3, lambda i, v: jax.lax.pmax(v, "dp"), c[:5])
        return (b.astype(jnp.float32).sum() + c.sum() + d.sum())[None, None]

    f = _smap(body, 2)
    x, it = jnp.ones((N, 16)), jnp.ones((N, 1), jnp.int32)
    rep = comm_report(f, x, it)
    got = sorted((c.op, c.dtype, c.elements, c.bytes, c.result_elements, c.group_size,
                  bool(c.branch), c.in_loop) for c in rep.collectives)
    assert got == sorted([
        ("reduce-scatter", "f32", 16, 64, 2, 8, False, False),
        ("all-gather", "bf16", 2, 4, 16, 8, False, False),
        ("all-reduce", "f32", 16, 64, 16, 8, True, False),
        ("all-reduce", "f16", 4, 8, 4, 8, True, False),
        ("all-reduce", "f32", 5, 20, 5, 8, False, True),
    ])
    assert rep.bytes_max == 64 + 4 + 64 + 20 and rep.bytes_min == 64 + 4 + 8 + 20
    with pytest.raises(ValueError, match="collectives inside conditionals"):
        _ = rep.bytes
    assert rep.by_op()[("all-reduce", "f32")] == (2, 84)
    assert "reduce-scatter" in str(rep) and "(loop)" in rep.table()
    # the same from a Lowered object and from the HLO text
    lowered = f.lower(x, it)
    assert comm_report(lowered).collectives == rep.collectives
    assert comm_report(lowered.as_text(dialect="hlo")).bytes_max == rep.bytes_max


def test_compiled_program_shows_what_the_backend_runs():
    f = _smap(lambda x: jax.lax.psum(x.astype(jnp.bfloat16), "dp").astype(jnp.float32))
    x = jnp.ones((N, 1024))
    asked = comm_report(f, x)
    assert [(c.dtype, c.bytes) for c in asked.collectives] == [("bf16", 2048)]
    ran = comm_report(f.lower(x).compile())
    assert ran.source == "compiled" and len(ran.collectives) == 1
    # XLA:CPU promotes bf16 all-reduces to f32: bf16 saves bytes only on GPU/TPU
    if jax.default_backend() == "cpu":
        assert [(c.dtype, c.bytes) for c in ran.collectives] == [("f32", 4096)]


def test_bad_inputs():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        parse_hlo_collectives("HloModule m\n")
    with pytest.raises(TypeError, match="wrap plain functions in jax.jit first"):
        comm_report(lambda x: x, 1)
    f = _smap(lambda x: x)
    with pytest.raises(TypeError, match="already lowered/compiled"):
        comm_report(f.lower(jnp.ones((N, 2))), 1)
