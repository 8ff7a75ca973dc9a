"""Ring all-reduce (jdist.collectives.functional.ring_all_reduce) against lax.psum.

Both run in the same process on N virtual CPU devices (default 8), inside one jitted
``shard_map`` each, on float32 arrays of several sizes per replica. Prints the median
time of each and the ratio ring / psum, and checks that the results agree. The last
line, ``BENCH_JSON {...}``, holds the same numbers for benchmarks/run_all.py.

    PYTHONPATH=. python benchmarks/ring_allreduce.py [--devices 8] [--reps 20] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _setup_devices(n: int) -> None:
    from jdist.launch import xla_flags_with_devices  # imports no JAX

    os.environ["XLA_FLAGS"] = xla_flags_with_devices(os.environ.get("XLA_FLAGS", ""), n)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _time(fn, x, reps: int) -> float:
    fn(x).block_until_ready()  # compile and warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(x).block_until_ready()  # block every step (virtual-device collectives)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sizes", type=int, nargs="*",
                   default=[1 << 10, 1 << 14, 1 << 18, 1 << 20],
                   help="float32 elements per replica")
    p.add_argument("--quick", "--smoke", action="store_true",
                   help="two small sizes, 5 repetitions")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.reps = [1 << 10, 1 << 16], 5
    _setup_devices(args.devices)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks._parse import bench_json, row, table
    from jdist.collectives import functional as F
    from jdist.collectives._group import make_mesh

    devices = jax.devices()[: args.devices]
    if len(devices) < args.devices:
        print(f"only {len(devices)} devices available, wanted {args.devices}", file=sys.stderr)
        return 1
    mesh = make_mesh(devices, "dp")
    n = len(devices)

    def program(body):
        return jax.jit(jax.shard_map(lambda b: body(b[0])[None], mesh=mesh,
                                     in_specs=P("dp"), out_specs=P("dp")))

    ring = program(lambda v: F.ring_all_reduce(v, "dp"))
    psum = program(lambda v: jax.lax.psum(v, "dp"))

    print(f"ring_all_reduce vs lax.psum, {n} virtual CPU devices, "
          f"{jax.devices()[0].platform}, median of {args.reps}")
    print(f"{'elements':>10} {'bytes/replica':>14} {'psum ms':>10} {'ring ms':>10} "
          f"{'ring/psum':>10}")
    rows = []
    for size in args.sizes:
        x = np.random.RandomState(0).randn(n, size).astype(np.float32)
        x = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("dp")))
        np.testing.assert_allclose(np.asarray(ring(x)), np.asarray(psum(x)),
                                   rtol=1e-4, atol=1e-4)
        t_psum = _time(psum, x, args.reps)
        t_ring = _time(ring, x, args.reps)
        print(f"{size:>10} {4 * size:>14} {1e3 * t_psum:>10.3f} {1e3 * t_ring:>10.3f} "
              f"{t_ring / t_psum:>10.2f}x")
        rows.append(row(f"{size} float32 per replica", "ms", 1e3 * t_ring, 1e3 * t_psum,
                        t_ring / t_psum))
    print(bench_json("ring_allreduce", [table(
        f"ring_all_reduce vs lax.psum, {n} virtual CPU devices, median of {args.reps}",
        "lax.psum", "ring / psum (lower is better)", rows)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
