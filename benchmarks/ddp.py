"""DistributedDataParallel: jdist vs a hand-written JAX step, and vs torch DDP.

Run: ``PYTHONPATH=. python benchmarks/ddp.py [--steps 30] [--devices 2] [--skip-torch]
[--quick]`` (``--quick``: 5 steps, only the default jdist variant).

Three comparisons, each jdist and its baseline in the same run (medians of timed steps
after warm-up, every step blocked on):

a) **overhead**: jdist ``ddp.train_step`` vs a hand-written ``jit(shard_map)`` step
   (``pcast`` params, ``jax.grad``, one ``pmean`` per gradient, SGD) on the same mesh of
   ``--devices`` virtual devices in this process, for the MLP 784-1024-1024-1024-10 at
   batch 128. jdist runs with its default options (on one process: one all-reduce per
   bucket, made by XLA's combiner from the bucket's gradients), with XLA's defaults
   (``compiler_options={}``) and with flat bucket buffers (``flat_buckets=True``: each
   bucket copied into one array, the layout comm hooks get). Goal: <= 1.05x. Two
   like-for-like rows follow: a hand-written step with one flat all-reduce per bucket
   (what bucketing costs on XLA when it needs a copy) and jdist's functional entry point
   (a params pytree and optax, no NNX module).
b) **vs torch DDP**: 2 processes x 1 device, gloo, one thread each, global batch 128,
   for the MLP and a small CNN (conv 1->16->32, 3x3, on 28x28 inputs); ms per step.
   jdist's default across processes on CPU is flat bucket buffers (gloo runs one
   collective per array); the row without the copy shows why.
   Goal: MLP at or below torch's step time. For attribution, each model's step is also
   timed on one process and one device with no communication (torch vs plain JAX), so
   the rest of the gap is communication and DDP overhead.
c) **compile time**: jdist's first step (tracing, recording the gradient-ready order,
   compiling) vs the hand-written step's first call.

Ratios are jdist / baseline (lower is better). The last line, ``BENCH_JSON {...}``, holds
the same numbers for benchmarks/run_all.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

BATCH = 128
VARIANTS = [  # label, compiler_options, flat_buckets (None: jdist's choice)
    ("jdist", None, None),
    ("jdist (XLA defaults)", {}, None),
    ("jdist (flat bucket buffers)", None, True),
]
VARIANTS_B = [  # (b): jdist's choice across processes is flat buffers
    ("jdist", None, None),
    ("jdist (no flat copy)", None, False),
]


def _median_ms(fn, steps, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


# ----------------------------------------------------------------------------- models
def nnx_model(kind):
    import jax.numpy as jnp
    from flax import nnx

    r = nnx.Rngs(0)

    class MLP(nnx.Module):
        def __init__(self):
            sizes = (784, 1024, 1024, 1024, 10)
            self.layers = nnx.List([nnx.Linear(a, b, rngs=r)
                                    for a, b in zip(sizes, sizes[1:], strict=False)])

        def __call__(self, x):
            for i, layer in enumerate(self.layers):
                x = layer(x)
                x = nnx.relu(x) if i < len(self.layers) - 1 else x
            return x

    class CNN(nnx.Module):
        def __init__(self):
            self.c1 = nnx.Conv(1, 16, (3, 3), padding="VALID", rngs=r)
            self.c2 = nnx.Conv(16, 32, (3, 3), padding="VALID", rngs=r)
            self.fc = nnx.Linear(12 * 12 * 32, 10, rngs=r)

        def __call__(self, x):
            x = nnx.relu(self.c2(nnx.relu(self.c1(x))))
            x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
            return self.fc(jnp.reshape(x, (x.shape[0], -1)))

    return MLP() if kind == "mlp" else CNN()


def batch(kind, n, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, 784).astype(np.float32) if kind == "mlp" else \
        rng.randn(n, 28, 28, 1).astype(np.float32)
    return {"x": x, "y": rng.randint(0, 10, n).astype(np.int32)}


def loss_fn(model, b):
    import optax

    logits = model(b["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()


# ----------------------------------------------------------------------------- (a), (c)
def handwritten_step(model, mesh, axis):
    """The baseline: jit(shard_map) with pmean per gradient and SGD, no jdist."""
    import jax
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    gdef, params = nnx.split(model, nnx.Param)

    def body(p, b):
        pv = jax.lax.pcast(p, axis, to="varying")
        loss, g = jax.value_and_grad(lambda q: loss_fn(nnx.merge(gdef, q), b))(pv)
        g = jax.lax.pmean(g, axis)
        return jax.lax.pmean(loss, axis), jax.tree.map(lambda a, d: a - 0.01 * d, p, g)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axis)),
                              out_specs=(P(), P()), check_vma=True))
    return f, params


def handwritten_bucketed_step(model, mesh, axis, buckets):
    """A second, like-for-like baseline: ``handwritten_step`` with jdist's bucket layout.

    Each bucket's gradients are concatenated into one flat buffer, averaged by one
    ``pmean`` (one all-reduce per bucket, as torch's DDP and the issue's rule require) and
    split again; compiled with XLA:CPU's all-reduce combiner off, as jdist is, so the
    buckets stay separate. The difference to ``handwritten_step`` is the cost of bucketing
    on XLA (SPMD programs cannot all-reduce several arrays in one op, so a bucket is a
    copy), the difference to jdist is jdist's own overhead.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    gdef, params = nnx.split(model, nnx.Param)
    groups = [list(b.leaves) for b in buckets]

    def body(p, b):
        pv = jax.lax.pcast(p, axis, to="varying")
        loss, g = jax.value_and_grad(lambda q: loss_fn(nnx.merge(gdef, q), b))(pv)
        leaves, tdef = jax.tree.flatten(g)
        out = list(leaves)
        for grp in groups:
            buf = jax.lax.pmean(jnp.concatenate([jnp.ravel(leaves[j]) for j in grp]), axis)
            pos = 0
            for j in grp:
                out[j] = jnp.reshape(buf[pos:pos + leaves[j].size], leaves[j].shape)
                pos += leaves[j].size
        g = jax.tree.unflatten(tdef, out)
        return jax.lax.pmean(loss, axis), jax.tree.map(lambda a, d: a - 0.01 * d, p, g)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axis)),
                              out_specs=(P(), P()), check_vma=True),
                compiler_options={"xla_disable_hlo_passes": "cpu-all-reduce-combiner"})
    return f, params


def mlp_params(model):
    """The MLP's weights as a plain pytree (for jdist's functional entry point)."""
    return [{"w": layer.kernel[...], "b": layer.bias[...]} for layer in model.layers]


def mlp_loss(params, b):
    import jax
    import optax

    x = b["x"]
    for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        x = jax.nn.relu(x) if i < len(params) - 1 else x
    return optax.softmax_cross_entropy_with_integer_labels(x, b["y"]).mean()


FUNCTIONAL = "jdist FunctionalDDP (params pytree, optax)"
BUCKETED = "hand-written, one flat all-reduce per bucket"


def overhead(kind, steps, variants=VARIANTS):
    """Interleaved timings (one step of each contender per round) of jdist vs hand-written."""
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jdist.ddp import DistributedDataParallel as DDP

    b = batch(kind, BATCH)
    runs, out = {}, {}
    for label, opts, flat in variants:
        model = nnx_model(kind)
        ddp = DDP(model, compiler_options=opts, flat_buckets=flat)
        step = ddp.train_step(loss_fn, nnx.Optimizer(model, optax.sgd(0.01), wrt=nnx.Param))
        runs[label] = (lambda s: lambda: float(s(b)))(step)
    group = ddp.process_group
    f, params = handwritten_step(nnx_model(kind), group.mesh, group.axis_name)
    sharding = NamedSharding(group.mesh, P(group.axis_name))
    state = {"p": jax.device_put(params, NamedSharding(group.mesh, P()))}

    def hand():  # feeds a host batch every step, as a training loop does
        loss, state["p"] = f(state["p"], jax.device_put(b, sharding))
        return float(loss)

    runs["hand"] = hand
    if kind == "mlp":  # like-for-like rows: jdist's functional entry point, bucketed baseline
        fddp = jdist_functional(nnx_model(kind))
        fstep = fddp.train_step(mlp_loss, optax.sgd(0.01))
        runs[FUNCTIONAL] = lambda: float(fstep(b))
        bstate = {}

        def bucketed():  # built at its first call, after jdist's first step rebuilt buckets
            if not bstate:
                bstate["f"], p0 = handwritten_bucketed_step(
                    nnx_model(kind), group.mesh, group.axis_name, ddp.buckets.buckets)
                bstate["p"] = jax.device_put(p0, NamedSharding(group.mesh, P()))
            loss, bstate["p"] = bstate["f"](bstate["p"], jax.device_put(b, sharding))
            return float(loss)

        runs[BUCKETED] = bucketed
    times = {k: [] for k in runs}
    for k, fn in runs.items():
        t = time.perf_counter()
        fn()
        out[k + " compile"] = time.perf_counter() - t
    for _ in range(3):
        for fn in runs.values():
            fn()
    for _ in range(steps):
        for k, fn in runs.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    out.update({k: 1e3 * statistics.median(v) for k, v in times.items()})
    return out


def jdist_functional(model):
    from jdist.ddp import FunctionalDDP

    return FunctionalDDP(mlp_params(model))


# ----------------------------------------------------------------------------- (b)
def torch_worker(kind, steps):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                              nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                              nn.Linear(1024, 10))
    else:
        model = nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(),
                              nn.AvgPool2d(2), nn.Flatten(), nn.Linear(12 * 12 * 32, 10))
    ddp = TorchDDP(model)
    st = {"ddp": ddp, "opt": torch.optim.SGD(ddp.parameters(), lr=0.01)}
    del ddp
    b = batch(kind, BATCH // world, seed=rank)
    x = torch.from_numpy(b["x"] if kind == "mlp" else b["x"].transpose(0, 3, 1, 2).copy())
    y = torch.from_numpy(b["y"]).long()

    def step():
        st["opt"].zero_grad()
        loss = nn.functional.cross_entropy(st["ddp"](x), y)
        loss.backward()
        st["opt"].step()
        return float(loss.detach())

    ms = _median_ms(step, steps)
    # release the DDP reducer (and its gloo work) before the group goes away: one that
    # outlives destroy_process_group() can abort torch at exit ("terminate called
    # without an active exception"), as tests/compare/ddp_cases.py found
    st.clear()
    import gc

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return ms


def jdist_worker(kind, steps, opts=None, flat=None):
    import optax
    from flax import nnx

    import jdist
    from jdist.ddp import DistributedDataParallel as DDP

    jdist.collectives.init_process_group()
    rank, world = jdist.collectives.get_rank(), jdist.collectives.get_world_size()
    model = nnx_model(kind)
    ddp = DDP(model, compiler_options=opts, flat_buckets=flat)
    step = ddp.train_step(loss_fn, nnx.Optimizer(model, optax.sgd(0.01), wrt=nnx.Param))
    b = batch(kind, BATCH // world, seed=rank)
    t = time.perf_counter()
    float(step(b))
    compile_s = time.perf_counter() - t
    ms = _median_ms(lambda: float(step(b)), steps)
    jdist.collectives.destroy_process_group()
    return ms, compile_s


# ----------------------------------------------------------------------------- (d)
SMALL_WIDTH, SMALL_LAYERS, SMALL_BATCH = 200, 5, 32


def _small_batch(rank):
    rng = np.random.default_rng(rank)
    return (rng.standard_normal((SMALL_BATCH, SMALL_WIDTH)).astype(np.float32),
            rng.standard_normal((SMALL_BATCH, SMALL_WIDTH)).astype(np.float32))


def _times_ms(step, steps, warmup=20):
    for _ in range(warmup):
        step()
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        out.append(1e3 * (time.perf_counter() - t))
    return out


def torch_small_worker(steps):
    """torch DDP, 5 x Linear(200, 200), SGD: every step's time (ms)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    st = {"ddp": TorchDDP(nn.Sequential(*[nn.Linear(SMALL_WIDTH, SMALL_WIDTH)
                                          for _ in range(SMALL_LAYERS)]))}
    st["opt"] = torch.optim.SGD(st["ddp"].parameters(), lr=0.01)
    x, y = (torch.from_numpy(a) for a in _small_batch(dist.get_rank()))

    def step():
        st["opt"].zero_grad()
        loss = nn.functional.mse_loss(st["ddp"](x), y)
        loss.backward()
        st["opt"].step()
        return float(loss.detach())

    times = _times_ms(step, steps)
    st.clear()
    import gc

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return times


def jdist_small_worker(steps):
    """jdist DDP, 5 x Linear(200, 200), SGD: every step's time (ms)."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jdist
    from jdist.ddp import DistributedDataParallel as DDP

    class Stack(nnx.Module):
        def __init__(self):
            r = nnx.Rngs(0)
            self.layers = nnx.List([nnx.Linear(SMALL_WIDTH, SMALL_WIDTH, rngs=r)
                                    for _ in range(SMALL_LAYERS)])

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    jdist.collectives.init_process_group()
    model = Stack()
    step = DDP(model).train_step(lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2),
                                 nnx.Optimizer(model, optax.sgd(0.01), wrt=nnx.Param))
    b = _small_batch(jdist.collectives.get_rank())
    times = _times_ms(lambda: float(step(b)), steps)
    jdist.collectives.destroy_process_group()
    return times


def small_steps(steps):
    """(d): median and p99 of every step, both ranks' times pooled, torch then jdist."""
    from benchmarks import ddp as me
    from jdist.launch import spawn

    env = _one_thread_env()
    out = {}
    for lib, fn in (("torch", me.torch_small_worker), ("jdist", me.jdist_small_worker)):
        res = spawn(fn, args=(steps,), nprocs=2, timeout=900, env=env)
        t = np.concatenate([np.asarray(r) for r in res])
        out[lib] = (float(np.median(t)), float(np.percentile(t, 99)), float(t.max()))
    return out


def compute_only(kind, steps):
    """One process, one device, no communication: jit(grad) step vs torch fwd+bwd+SGD."""
    import jax
    import optax
    import torch
    from flax import nnx
    from torch import nn

    torch.set_num_threads(1)
    b = batch(kind, BATCH // 2)
    model = nnx_model(kind)
    opt = nnx.Optimizer(model, optax.sgd(0.01), wrt=nnx.Param)

    @nnx.jit
    def jstep(m, o, bb):
        loss, g = nnx.value_and_grad(loss_fn)(m, bb)
        o.update(m, g)
        return loss

    jb = jax.device_put(b)
    j_ms = _median_ms(lambda: float(jstep(model, opt, jb)), steps)
    torch.manual_seed(0)
    if kind == "mlp":
        tm = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                           nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        x = torch.from_numpy(b["x"])
    else:
        tm = nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(),
                           nn.AvgPool2d(2), nn.Flatten(), nn.Linear(12 * 12 * 32, 10))
        x = torch.from_numpy(b["x"].transpose(0, 3, 1, 2).copy())
    y = torch.from_numpy(b["y"]).long()
    topt = torch.optim.SGD(tm.parameters(), lr=0.01)

    def tstep():
        topt.zero_grad()
        loss = nn.functional.cross_entropy(tm(x), y)
        loss.backward()
        topt.step()
        return float(loss)

    return _median_ms(tstep, steps), j_ms


def _one_thread_env():
    return {"OMP_NUM_THREADS": "1", "JDIST_XLA_CPU_THREADS": "1"}  # (jdist._xla_threads)


def vs_torch(kind, steps, variants=VARIANTS_B):
    from benchmarks import ddp as me
    from jdist.launch import spawn

    env = _one_thread_env()
    torch_ms = spawn(me.torch_worker, args=(kind, steps), nprocs=2, timeout=600, env=env)
    out = {}
    for label, opts, flat in variants:
        res = spawn(me.jdist_worker, args=(kind, steps, opts, flat), nprocs=2, timeout=600,
                    env=env)
        out[label] = (max(r[0] for r in res), max(r[1] for r in res))
    return max(torch_ms), out


def compute_only_one_thread(kind, steps):
    from benchmarks import ddp as me
    from jdist.launch import spawn

    return spawn(me.compute_only, args=(kind, steps), nprocs=1, timeout=600,
                 env=_one_thread_env())[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--devices", type=int, default=2, help="devices for (a) and (c)")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="5 steps, only the default jdist variant (for benchmarks/run_all.py)")
    ap.add_argument("--small-steps", type=int, default=2000,
                    help="(d): steps of the small model per side (>= 1000 for its p99)")
    ap.add_argument("--only-small", action="store_true", help="run only (d)")
    args = ap.parse_args(argv)
    variants = VARIANTS[:1] if args.quick else VARIANTS
    if args.quick:
        args.steps = 5
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if "jax" not in sys.modules:
        from jdist.launch import xla_flags_with_devices  # imports no JAX

        os.environ["XLA_FLAGS"] = xla_flags_with_devices(os.environ.get("XLA_FLAGS", ""),
                                                         args.devices)

    from benchmarks._parse import bench_json, row, table

    small = [] if args.skip_torch else _small_rows(args, row)
    if args.only_small:
        print(bench_json("ddp", [_small_table(small, table)]))
        return
    print(f"(a)+(c) one process, {args.devices} devices, MLP 784-1024x3-10, batch {BATCH}")

    o = overhead("mlp", args.steps, variants)
    print(f"  {'hand-written shard_map+pmean step':34s} {o['hand']:8.2f} ms   "
          f"compile {o['hand compile']:.2f} s")
    over, comp, vs, attr, series = [], [], [], [], {}
    for label, _, _ in variants:
        print(f"  {label:34s} {o[label]:8.2f} ms   compile {o[label + ' compile']:.2f} s   "
              f"ratio {o[label] / o['hand']:.3f}x   compile ratio "
              f"{o[label + ' compile'] / o['hand compile']:.2f}x")
        over.append(row(label, "ms", o[label], o["hand"], o[label] / o["hand"]))
        c, hc = o[label + " compile"], o["hand compile"]
        comp.append(row(f"{label}, first step", "s", c, hc, c / hc))
    like = []
    if BUCKETED in o:
        print("  like-for-like rows:")
        print(f"  {BUCKETED:46s} {o[BUCKETED]:8.2f} ms   compile "
              f"{o[BUCKETED + ' compile']:.2f} s   ratio to hand-written "
              f"{o[BUCKETED] / o['hand']:.3f}x")
        flat = [v[0] for v in variants if v[2]]
        j = flat[0] if flat else variants[0][0]
        print(f"  {j + ' / bucketed hand-written':46s} ratio {o[j] / o[BUCKETED]:.3f}x")
        print(f"  {FUNCTIONAL:46s} {o[FUNCTIONAL]:8.2f} ms   compile "
              f"{o[FUNCTIONAL + ' compile']:.2f} s   ratio {o[FUNCTIONAL] / o['hand']:.3f}x")
        like = [row(f"{j} vs {BUCKETED}", "ms", o[j], o[BUCKETED], o[j] / o[BUCKETED],
                    "same flat buckets: jdist's own overhead" if flat else
                    "jdist without the copy"),
                row(f"{BUCKETED} vs hand-written", "ms", o[BUCKETED], o["hand"],
                    o[BUCKETED] / o["hand"], "the cost of flat buckets on XLA:CPU"),
                row(f"{FUNCTIONAL} vs hand-written", "ms", o[FUNCTIONAL], o["hand"],
                    o[FUNCTIONAL] / o["hand"], "no NNX module")]
    if not args.skip_torch:
        print(f"(b) 2 processes x 1 device, gloo, 1 thread each, global batch {BATCH}")
    for kind in () if args.skip_torch else ("mlp", "cnn"):
        t_ms, res = vs_torch(kind, args.steps, VARIANTS_B[:1] if args.quick else VARIANTS_B)
        print(f"  {kind}: torch DDP {t_ms:8.2f} ms")
        series[kind] = {"torch DDP": t_ms}
        for label, (j_ms, j_compile) in res.items():
            print(f"       {label:34s} {j_ms:8.2f} ms   ratio {j_ms / t_ms:.2f}x   "
                  f"(first step {j_compile:.2f} s)")
            series[kind][label] = j_ms
            vs.append(row(f"{kind}: {label}", "ms", j_ms, t_ms, j_ms / t_ms,
                          f"first step {j_compile:.2f} s"))
        tc, jc = compute_only_one_thread(kind, args.steps)
        print(f"       compute only (1 process, 1 device, batch {BATCH // 2}, no "
              f"communication): torch {tc:8.2f} ms   JAX {jc:8.2f} ms   ratio {jc / tc:.2f}x")
        attr.append(row(f"{kind}: plain JAX step", "ms", jc, tc, jc / tc,
                        "1 process, 1 device, no communication"))
    tables = [table(f"(a) DDP step, one process, {args.devices} devices: jdist vs a "
                    f"hand-written jit(shard_map) + pmean step", "hand-written",
                    "jdist / hand-written (lower is better; goal <= 1.05)", over)]
    if like:
        tables.append(table("(a) like-for-like: bucketed baseline and functional entry point",
                            "baseline", "subject / baseline (lower is better)", like,
                            subject="subject"))
    if vs:
        tables += [table("(b) DDP step, 2 processes (gloo): jdist vs torch DDP", "torch DDP",
                         "jdist / torch (lower is better)", vs),
                   table("(b) attribution: compute only, no communication", "torch",
                         "JAX / torch", attr, subject="plain JAX")]
    tables.append(table("(c) first step (trace + compile)", "hand-written",
                        "jdist / hand-written", comp))
    if small:
        tables.append(_small_table(small, table))
    print(bench_json("ddp", tables, {"ddp": series} if series else {}))


def _small_rows(args, row) -> list:
    n = 200 if args.quick else max(1000, args.small_steps)
    print(f"(d) 2 processes x 1 device, {SMALL_LAYERS} x Linear({SMALL_WIDTH}, "
          f"{SMALL_WIDTH}), batch {SMALL_BATCH} per process, SGD: {n} steps per rank "
          "after 20 warm-up steps, both ranks pooled", flush=True)
    got = small_steps(n)
    (jm, jp, jx), (tm, tp, tx) = got["jdist"], got["torch"]
    print(f"  median  jdist {jm:7.2f} ms  torch {tm:7.2f} ms  ratio {jm / tm:.2f}x")
    print(f"  p99     jdist {jp:7.2f} ms  torch {tp:7.2f} ms  ratio {jp / tp:.2f}x  "
          f"(goal <= 1.5)")
    print(f"  max     jdist {jx:7.2f} ms  torch {tx:7.2f} ms", flush=True)
    return [row("small model: median step", "ms", jm, tm, jm / tm, f"{n} steps x 2 ranks"),
            row("small model: p99 step", "ms", jp, tp, jp / tp, f"{n} steps x 2 ranks"),
            row("small model: slowest step", "ms", jx, tx, jx / tx, f"{n} steps x 2 ranks")]


def _small_table(rows, table) -> dict:
    return table(f"(d) small DDP steps ({SMALL_LAYERS} x Linear({SMALL_WIDTH}, "
                 f"{SMALL_WIDTH}), 2 processes): median and tail", "torch DDP",
                 "jdist / torch (lower is better; p99 goal <= 1.5)", rows)


if __name__ == "__main__":
    main()
