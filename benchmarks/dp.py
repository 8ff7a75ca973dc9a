"""DataParallel overhead: forward+backward of an MLP at batch 1024, 8 devices vs 1 device.

Runs both in one process and prints their times and the ratio. On a CPU-only machine the
8 devices are virtual (``--xla_force_host_platform_device_count``) and share its cores,
so no speedup is possible there: the ratio measures what DataParallel costs (dispatch,
copies, gather); the goal on a 2-core machine is <= 1.5x. On a multi-GPU machine it is a
speedup.

Two ways through DataParallel are timed: ``dp.value_and_grad(loss)`` (forward, loss and
backward as one compiled program over the 8-device sub-mesh: the goal row) and
``jax.value_and_grad`` through the eager ``dp.apply`` (JAX's eager autodiff around the
DataParallel programs, as torch users write it). The floor is the same SPMD program
hand-written, with the data already on the mesh.

  python benchmarks/dp.py [--batch 1024] [--devices 8] [--reps 20] [--quick]

The last line, ``BENCH_JSON {...}``, holds the same numbers for benchmarks/run_all.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _setup(devices: int) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jdist.launch import xla_flags_with_devices  # imports no JAX

    os.environ["XLA_FLAGS"] = xla_flags_with_devices(os.environ.get("XLA_FLAGS", ""), devices)


def _time(fns: list, reps: int) -> list[float]:
    """Median seconds per call of each fn, measured round-robin so load hits all alike."""
    import jax

    for fn in fns:
        for _ in range(3):
            jax.block_until_ready(fn())
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times, strict=True):
            t = time.perf_counter()
            jax.block_until_ready(fn())
            ts.append(time.perf_counter() - t)
    return [statistics.median(ts) for ts in times]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="5 repetitions")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps = 5
    if "jax" not in sys.modules:
        _setup(args.devices)
    import jax
    import jax.numpy as jnp

    from jdist.dp import DataParallel

    if len(jax.local_devices()) < args.devices:
        raise SystemExit(f"need {args.devices} devices, found {len(jax.local_devices())}")
    keys = jax.random.split(jax.random.key(0), 4)
    d_in, h, d_out = 256, args.hidden, 10
    params = {"w1": jax.random.normal(keys[0], (d_in, h)) / d_in ** 0.5, "b1": jnp.zeros(h),
              "w2": jax.random.normal(keys[1], (h, h)) / h ** 0.5, "b2": jnp.zeros(h),
              "w3": jax.random.normal(keys[2], (h, d_out)) / h ** 0.5, "b3": jnp.zeros(d_out)}
    x = jax.random.normal(keys[3], (args.batch, d_in))
    y = jnp.zeros((args.batch, d_out))

    def mlp(p, x):
        x = jax.nn.relu(x @ p["w1"] + p["b1"])
        x = jax.nn.relu(x @ p["w2"] + p["b2"])
        return x @ p["w3"] + p["b3"]

    mse = jax.jit(lambda out, y: jnp.mean((out - y) ** 2))
    single = jax.jit(jax.value_and_grad(lambda p: mse(mlp(p, x), y)))
    dp = DataParallel((mlp, params), device_ids=range(args.devices))
    through_dp = jax.value_and_grad(lambda p: mse(dp.apply(p, x), y))
    fused = dp.value_and_grad(lambda out, y: jnp.mean((out - y) ** 2))

    # the floor: the same SPMD program jitted end to end, data already on the mesh
    from jax.sharding import NamedSharding, PartitionSpec

    from jdist.dp._scatter_gather import mesh_for

    mesh = mesh_for(tuple(jax.local_devices()[:args.devices]))
    spmd = jax.shard_map(mlp, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec("dp")),
                         out_specs=PartitionSpec("dp"), check_vma=False)
    xs, ys, ps = (jax.device_put(v, NamedSharding(mesh, PartitionSpec(s)))
                  for v, s in ((x, "dp"), (y, "dp"), (params, None)))
    floor = jax.jit(jax.value_and_grad(lambda p: jnp.mean((spmd(p, xs) - ys) ** 2)))

    l1, g1 = single(params)
    l8, g8 = through_dp(params)
    lf, gf = fused(params, x, y)
    err = max(float(jnp.max(jnp.abs(a - b))) for g in (g8, gf) for a, b in
              zip(jax.tree.leaves(g1), jax.tree.leaves(g), strict=True))
    t1, tv, t8, tf = _time([lambda: single(params), lambda: fused(params, x, y),
                            lambda: through_dp(params), lambda: floor(ps)], args.reps)
    res = {"one_device_ms": t1 * 1e3, "fused_ms": tv * 1e3, "ratio": tv / t1,
           "data_parallel_ms": t8 * 1e3, "eager_ratio": t8 / t1,
           "spmd_floor_ms": tf * 1e3, "max_grad_diff": err,
           "loss_diff": max(abs(float(l1) - float(lf)), abs(float(l1) - float(l8)))}
    print(f"MLP {d_in}-{h}-{h}-{d_out}, batch {args.batch}, forward+backward "
          f"({jax.default_backend()}, {os.cpu_count()} cpus)")
    print(f"  one device (jit):                {res['one_device_ms']:8.2f} ms")
    print(f"  dp.value_and_grad, {args.devices} devices:   {res['fused_ms']:8.2f} ms")
    print(f"  jax.value_and_grad through eager dp: {res['data_parallel_ms']:8.2f} ms")
    print(f"  one jitted SPMD program, {args.devices} devices (floor, no DataParallel): "
          f"{res['spmd_floor_ms']:.2f} ms")
    print(f"  ratio dp.value_and_grad / one device: {res['ratio']:5.2f}x   goal <= 1.5 "
          f"({'ok' if res['ratio'] <= 1.5 else 'MISSED'}); eager: {res['eager_ratio']:.2f}x "
          f"(max |grad diff| {err:.2e})")
    res.update(_small(args.reps))
    from benchmarks._parse import bench_json, row, table

    print(bench_json("dp", [
        table(f"MLP {d_in}-{h}-{h}-{d_out}, batch {args.batch}, forward+backward",
              "baseline", "jdist / baseline (lower is better)", [
                  row(f"dp.value_and_grad over {args.devices} devices vs one device (jit)",
                      "ms", res["fused_ms"], res["one_device_ms"], res["ratio"],
                      "goal <= 1.5 on 2 cores (virtual devices share the cores)"),
                  row(f"jax.value_and_grad through eager DataParallel, {args.devices} "
                      f"devices vs one device (jit)", "ms", res["data_parallel_ms"],
                      res["one_device_ms"], res["eager_ratio"]),
                  row("dp.value_and_grad vs one jitted SPMD program (floor)", "ms",
                      res["fused_ms"], res["spmd_floor_ms"])]),
        table("tiny MLP 16-32-4, batch 40 over 5 devices (dispatch cost)", "one device (jit)",
              "jdist / one device", [
                  row("DataParallel (one SPMD program)", "ms", res["tiny_dp_ms"],
                      res["tiny_one_device_ms"]),
                  row("scatter/replicate/parallel_apply/gather per device", "ms",
                      res["tiny_loop_ms"], res["tiny_one_device_ms"])])]))
    return res


def _small(reps: int) -> dict:
    """Dispatch cost: a tiny MLP, batch 40 over 5 devices, forward+backward."""
    import jax
    import jax.numpy as jnp

    from jdist.dp import DataParallel, gather, parallel_apply, replicate, scatter

    k = jax.random.split(jax.random.key(1), 3)
    p = {"w1": jax.random.normal(k[0], (16, 32)) / 4, "b1": jnp.zeros(32),
         "w2": jax.random.normal(k[1], (32, 4)) / 6, "b2": jnp.zeros(4)}
    x = jax.random.normal(k[2], (40, 16))

    def mlp(p, x):
        return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

    devs = jax.local_devices()[:5]
    mse = jax.jit(lambda o: jnp.mean(o ** 2))
    dp = DataParallel((mlp, p), device_ids=devs)
    fused = jax.value_and_grad(lambda p: mse(dp.apply(p, x)))
    loop = jax.value_and_grad(lambda p: mse(gather(
        parallel_apply(mlp, replicate(p, devs), scatter(x, devs), devices=devs), devs[0])))
    single = jax.jit(jax.value_and_grad(lambda p: mse(mlp(p, x))))
    # one at a time: the per-device loop leaves threads busy that would slow its neighbours
    t_fused, t_loop, t_one = (_time([f], reps)[0] for f in
                              (lambda: fused(p), lambda: loop(p), lambda: single(p)))
    print("tiny MLP 16-32-4, batch 40 over 5 devices, forward+backward (dispatch cost)")
    print(f"  DataParallel (one SPMD program):                  {t_fused * 1e3:8.2f} ms")
    print(f"  scatter/replicate/parallel_apply/gather per device: {t_loop * 1e3:6.2f} ms")
    print(f"  one device (jit):                                 {t_one * 1e3:8.2f} ms")
    return {"tiny_dp_ms": t_fused * 1e3, "tiny_loop_ms": t_loop * 1e3,
            "tiny_one_device_ms": t_one * 1e3}


if __name__ == "__main__":
    main()
