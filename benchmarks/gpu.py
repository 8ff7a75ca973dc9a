"""GPU checks and timings: what only a GPU machine can show (run where one is lent).

Run: ``PYTHONPATH=. python benchmarks/gpu.py [--out DIR] [--steps 30]`` (DIR defaults to
.tmp/gpu-out). On a machine without a GPU, ``--dry-run`` runs every part on XLA:CPU (8
virtual devices for the schedule part, fewer steps) to check the script itself; its
numbers mean nothing.

Parts, each in its own subprocess (JAX's backend options are fixed at start):

1. **schedule**: the DDP gradient program of an MLP (8 x Linear(1024, 1024)), compiled by
   XLA:GPU for 8 GPUs. One machine has one GPU, so the 8 are mocked (JAX's
   ``mock_num_gpu_processes``: this process is rank 0 of 8, the other ranks' devices exist
   for the compiler, NCCL is a stub): the program is compiled, not run. From the
   compiled, scheduled HLO it reports each all-reduce (asynchronous on GPU:
   ``all-reduce-start``/``-done``), its bytes, and how many computations the latency
   hiding scheduler placed between its start and its done (work that overlaps the
   reduction), for jdist with ``bucket_cap_mb`` 25 and 4, for jdist with the latency
   hiding scheduler off, and for a hand-written ``shard_map`` + ``pmean`` step. Each case
   compiles in its own process with ``--xla_gpu_autotune_level=0``: under the mock
   topology XLA:GPU's GEMM autotuner hung (no progress in 200 s on an H200, jax 0.11.2),
   and autotuning picks kernels, not the schedule's structure.
2. **timing**: one process, one GPU. jdist ``ddp.train_step`` vs a hand-written jit step
   (the overhead of DDP's machinery where the program itself is tiny: a small MLP) and on a
   compute-bound MLP; torch's DDP (``world_size=1``, NCCL) and plain torch steps on the
   same models, in fp32 and with TF32 matmuls. Medians of timed steps, batches on device.
3. **nccl-2proc**: two jdist processes on the one GPU (``jdist-run --nproc-per-node 2``,
   backend NCCL) run an eager ``all_reduce``. NCCL does not allow two ranks on one GPU, so
   the expected result is its refusal, recorded, not a hang (hard timeout).

Each part prints a table; the last line, ``GPU_JSON {...}``, holds all numbers (also
written to ``DIR/gpu.json`` with the compiled HLO of the schedule part).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH, DEPTH, PER_DEVICE = 1024, 8, 64
ALWAYS_SKIP = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant",
               "copy-start", "copy-done", "all-reduce-start", "all-reduce-done",
               "all-reduce", "after-all", "partition-id", "replica-id"}


# ----------------------------------------------------------------------------- HLO
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s([a-z][a-z0-9\-]*)\(")
_ARRAY = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def _instructions(text):
    """(computation, [(name, opcode, rest)]) for each computation of an HLO module text."""
    comps, cur, body = [], None, []
    for line in text.splitlines():
        s = line.strip()
        if s.endswith("{") and ("(" in s or s.startswith("ENTRY")) and "=" not in s.split("(")[0]:
            cur, body = s.split("(")[0].replace("ENTRY", "").strip().lstrip("%"), []
            continue
        if s == "}" and cur is not None:
            comps.append((cur, body))
            cur = None
            continue
        m = _INSTR.match(line)
        if cur is not None and m:
            rest = " " + m.group(2)
            op = _OPCODE.search(rest)
            body.append((m.group(1), op.group(1) if op else "?", rest))
    return comps


def _array_bytes(shape_text):
    total = 0
    for dt, dims in _ARRAY.findall(shape_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BYTES[dt]
    return total


def _is_start(name, op):
    return op == "all-reduce-start" or (op == "async-start" and name.startswith("all-reduce"))


def collective_schedule(text):
    """Each all-reduce of a scheduled HLO module: bytes and the compute placed around it.

    XLA:GPU runs an all-reduce asynchronously: an ``all-reduce-start`` (printed as an
    ``async-start`` of a wrapped all-reduce) and its ``-done``; XLA:CPU runs it in one
    ``all-reduce`` op. Returns a list of dicts: ``bytes`` (reduced), ``async_`` (a
    start/done pair), ``overlapped`` (computations scheduled between start and done),
    ``after`` (computations scheduled after it: later backward work), ``total``.
    """
    comps = _instructions(text)
    wrapped = set()  # the computations async-starts call: their all-reduce is counted once
    for _, body in comps:
        for name, op, rest in body:
            if _is_start(name, op):
                wrapped.update(re.findall(r"calls=%?([\w.\-]+)", rest))
    out = []
    for cname, body in comps:
        if cname in wrapped:
            continue
        compute = [op not in ALWAYS_SKIP and not op.startswith("async-")
                   for _, op, _ in body]
        for i, (name, op, rest) in enumerate(body):
            if op == "all-reduce":
                done, shape = i, rest.split(f" {op}(")[0]
            elif _is_start(name, op):
                done, shape = i, ""
                for j in range(i + 1, len(body)):
                    if re.search(rf"[\s(%]{re.escape(name)}[,)\s]", body[j][2]):
                        done, shape = j, body[j][2].split(f" {body[j][1]}(")[0]
                        break
            else:
                continue
            out.append(dict(bytes=_array_bytes(shape), async_=done != i,
                            overlapped=sum(compute[i + 1:done]),
                            after=sum(compute[done + 1:]), total=sum(compute)))
    return out


# ----------------------------------------------------------------------------- part 1
def _mlp_params(key_seed=0):
    rng = np.random.RandomState(key_seed)
    sizes = [WIDTH] * (DEPTH + 1)
    return [{"w": (rng.randn(a, b) / np.sqrt(a)).astype(np.float32),
             "b": np.zeros(b, np.float32)} for a, b in zip(sizes, sizes[1:], strict=False)]


def _mlp_loss(params, batch):
    import jax
    import jax.numpy as jnp

    x = batch["x"]
    for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return jnp.mean((x - batch["y"]) ** 2)


def schedule_part(dry_run, only=None):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jdist.collectives._group import ProcessGroup, make_mesh
    from jdist.ddp import _program
    from jdist.ddp._ddp import leaf_infos
    from jdist.ddp._engine import Engine

    devs = jax.devices()
    print(f"devices: {len(devs)}, local {jax.local_device_count()}", file=sys.stderr,
          flush=True)
    n = len(devs)
    mesh = make_mesh(devs)
    group = ProcessGroup(ranks=tuple(range(n)), rank=0, mesh=mesh, axis_name="dp",
                         backend="gloo" if dry_run else "nccl",
                         devices_per_rank=tuple((d,) for d in devs), name="SCHEDULE")
    params = _mlp_params()
    rep, row = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    p_sds = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep),
                         params)
    b_sds = {k: jax.ShapeDtypeStruct((PER_DEVICE * n, WIDTH), np.float32, sharding=row)
             for k in ("x", "y")}

    def pure(p, buffers, batch, extra):
        return _mlp_loss(p, batch), (None, None)

    def jdist_text(cap, lhs=True):
        eng = Engine(group, leaf_infos(params), bucket_cap_mb=cap,
                     find_unused_parameters=False, broadcast_buffers=False)
        eng.ensure_layout(pure, p_sds, None, b_sds, ())
        if not lhs and not dry_run:  # jdist's own options, latency hiding scheduler off
            eng._user_options = {**eng.compiler_options,
                                 "xla_gpu_enable_latency_hiding_scheduler": False}
        prog = _program.grad_program(eng._config(), pure, None, sync=True,
                                     sync_buffers=False, has_acc=False)
        text = prog.lower(p_sds, None, None, None, None, b_sds, (), None).compile().as_text()
        return text, [b.nbytes for b in eng.layout.buckets], eng.compiler_options

    def hand_text():
        def body(p, b):
            pv = jax.lax.pcast(p, "dp", to="varying")
            loss, g = jax.value_and_grad(_mlp_loss)(pv, b)
            return jax.lax.pmean(loss, "dp"), jax.lax.pmean(g, "dp")

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("dp")),
                                  out_specs=(P(), P()), check_vma=True))
        return f.lower(p_sds, b_sds).compile().as_text(), None, {}

    cases = [("jdist, bucket_cap_mb=25 (default)", lambda: jdist_text(None)),
             ("jdist, bucket_cap_mb=4", lambda: jdist_text(4)),
             ("jdist, bucket_cap_mb=25, latency hiding scheduler off",
              lambda: jdist_text(None, lhs=False)),
             ("hand-written shard_map + pmean, XLA defaults", hand_text)]
    res, texts = [], {}
    for i, (label, fn) in enumerate(cases):
        if only is not None and i != only:
            continue
        print(f"compiling: {label}", file=sys.stderr, flush=True)
        t = time.perf_counter()
        text, buckets, opts = fn()
        secs = time.perf_counter() - t
        sched = collective_schedule(text)
        texts[i] = (label, text)
        big = [c for c in sched if c["bytes"] >= 4096]  # the loss pmean is 4 bytes
        res.append(dict(label=label, compile_s=secs, buckets=buckets,
                        compiler_options={k: str(v) for k, v in (opts or {}).items()},
                        all_reduces=len(big), reduced_bytes=[c["bytes"] for c in big],
                        overlapped=[c["overlapped"] for c in big],
                        after=[c["after"] for c in big],
                        total_compute=big[0]["total"] if big else 0,
                        asynchronous=all(c["async_"] for c in big) if big else None))
    return dict(devices=n, platform=devs[0].platform, model=f"MLP {DEPTH} x Linear("
                f"{WIDTH}, {WIDTH}), batch {PER_DEVICE} per device", cases=res), texts


def print_schedule(s):
    print(f"(1) DDP gradient program compiled for {s['devices']} {s['platform']} devices, "
          f"{s['model']}")
    for c in s["cases"]:
        mib = ", ".join(f"{b / 2**20:.1f}" for b in c["reduced_bytes"])
        print(f"  {c['label']}")
        print(f"     compile {c['compile_s']:.1f} s; {c['all_reduces']} all-reduce(s) "
              f"[{mib}] MiB; asynchronous: {c['asynchronous']}")
        if c["buckets"] is not None:
            print(f"     jdist buckets (MiB): "
                  f"{', '.join(f'{b / 2**20:.1f}' for b in c['buckets'])}")
        print(f"     computations between start and done: {c['overlapped']}; after done: "
              f"{c['after']} (of {c['total_compute']})")


# ----------------------------------------------------------------------------- part 2
MODELS = {"small": ((784, 1024, 1024, 1024, 10), 128),
          "large": ((4096, 4096, 4096, 4096, 4096, 10), 4096)}


def _nnx_mlp(sizes):
    import jax.numpy as jnp
    from flax import nnx

    r = nnx.Rngs(0)

    class MLP(nnx.Module):
        def __init__(self):
            self.layers = nnx.List([nnx.Linear(a, b, rngs=r)
                                    for a, b in zip(sizes, sizes[1:], strict=False)])

        def __call__(self, x):
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i < len(self.layers) - 1:
                    x = jnp.maximum(x, 0)
            return x

    return MLP()


def _ce(model, b):
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(model(b["x"]), b["y"]).mean()


def _jax_model_timing(sizes, bs, steps):
    import jax
    import optax
    from flax import nnx

    from jdist.ddp import DistributedDataParallel as DDP

    rng = np.random.RandomState(0)
    host = {"x": rng.randn(bs, sizes[0]).astype(np.float32),
            "y": rng.randint(0, sizes[-1], bs).astype(np.int32)}
    model = _nnx_mlp(sizes)
    ddp = DDP(model)
    step = ddp.train_step(_ce, nnx.Optimizer(model, optax.sgd(0.01), wrt=nnx.Param))
    g = ddp.process_group
    b = jax.device_put(host, jax.sharding.NamedSharding(g.mesh, jax.P(g.axis_name)))
    t = time.perf_counter()
    float(step(b))
    first = time.perf_counter() - t

    gdef, params = nnx.split(_nnx_mlp(sizes), nnx.Param)

    @jax.jit
    def hstep(p, batch):
        loss, gr = jax.value_and_grad(lambda q: _ce(nnx.merge(gdef, q), batch))(p)
        return loss, jax.tree.map(lambda a, d: a - 0.01 * d, p, gr)

    st = {"p": params}
    bd = jax.device_put(host, jax.devices()[0])

    def hand():
        loss, st["p"] = hstep(st["p"], bd)
        return float(loss)

    hand()
    tj, th = [], []
    for _ in range(3):
        float(step(b))
        hand()
    for _ in range(steps):  # interleaved, so drift hits both alike
        t = time.perf_counter()
        float(step(b))
        tj.append(time.perf_counter() - t)
        t = time.perf_counter()
        hand()
        th.append(time.perf_counter() - t)
    return dict(jdist_ms=1e3 * statistics.median(tj), hand_ms=1e3 * statistics.median(th),
                jdist_first_s=first, device=str(jax.devices()[0].device_kind))


def _models(dry_run):
    return {"small": MODELS["small"]} if dry_run else MODELS


def jax_timing(steps, dry_run=False):
    return {name: _jax_model_timing(sizes, bs, steps)
            for name, (sizes, bs) in _models(dry_run).items()}


def torch_timing(steps, dry_run=False):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from benchmarks.ddp import _median_ms

    if not torch.cuda.is_available() and not dry_run:
        return {"skipped": "torch sees no CUDA device"}
    dev = torch.device("cpu" if dry_run else "cuda:0")
    from jdist.launch import free_port

    port = free_port()
    dist.init_process_group("gloo" if dry_run else "nccl",
                            init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    out = {}
    for name, (sizes, bs) in _models(dry_run).items():
        for tf32 in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.manual_seed(0)
            layers = []
            for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False)):
                layers.append(nn.Linear(a, b))
                if i < len(sizes) - 2:
                    layers.append(nn.ReLU())
            x = torch.randn(bs, sizes[0], device=dev)
            y = torch.randint(0, sizes[-1], (bs,), device=dev)
            for wrap in ("ddp", "plain"):
                model = nn.Sequential(*layers).to(dev)
                m = (TorchDDP(model, device_ids=None if dry_run else [0]) if wrap == "ddp"
                     else model)
                opt = torch.optim.SGD(m.parameters(), lr=0.01)

                def step(m=m, opt=opt, x=x, y=y):
                    opt.zero_grad()
                    loss = nn.functional.cross_entropy(m(x), y)
                    loss.backward()
                    opt.step()
                    return float(loss.detach())

                out[f"{name} {wrap} {'tf32' if tf32 else 'fp32'}"] = _median_ms(step, steps)
                del m, opt
    import gc

    gc.collect()
    dist.destroy_process_group()
    return out


def print_timing(j, t):
    print("(2) one process, one GPU: ms per step (median), batch on device")
    for name, r in j.items():
        sizes, bs = MODELS[name]
        print(f"  {name} MLP {'-'.join(map(str, sizes))}, batch {bs} ({r['device']})")
        print(f"     jdist ddp.train_step {r['jdist_ms']:8.3f}   hand-written jit step "
              f"{r['hand_ms']:8.3f}   ratio {r['jdist_ms'] / r['hand_ms']:.3f}x   "
              f"(jdist first step {r['jdist_first_s']:.2f} s)")
        for prec in ("fp32", "tf32"):
            d, p = t.get(f"{name} ddp {prec}"), t.get(f"{name} plain {prec}")
            if d is not None:
                print(f"     torch {prec}: DDP {d:8.3f}   plain {p:8.3f}   jdist / torch DDP "
                      f"{r['jdist_ms'] / d:.3f}x")
    if "skipped" in t:
        print(f"  torch: {t['skipped']}")


# ----------------------------------------------------------------------------- part 3
NCCL_WORKER = """
import numpy as np, jdist
jdist.init_process_group(backend="nccl", timeout=40)
r = jdist.get_rank()
out = jdist.all_reduce(np.full(4, r + 1.0, np.float32))
print("RESULT", r, out.tolist(), flush=True)
jdist.destroy_process_group()
"""


def nccl_part(out_dir, dry_run):
    path = os.path.join(out_dir, "nccl_worker.py")
    with open(path, "w") as f:
        f.write(NCCL_WORKER.replace('"nccl"', '"gloo"') if dry_run else NCCL_WORKER)
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    t = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "jdist.launch", "--nproc-per-node", "2",
                            path], env=env, capture_output=True, text=True, timeout=60)
        rc, log = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, log = "timeout", (e.stdout or b"").decode(errors="replace") + \
            (e.stderr or b"").decode(errors="replace")
    keep = [ln for ln in log.splitlines()
            if re.search(r"RESULT|NCCL|nccl|Error|error|rank \d", ln)]
    return dict(rc=rc, seconds=time.perf_counter() - t, lines=keep[-12:])


# ----------------------------------------------------------------------------- driver
def _child(part, args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    if part == "schedule" and args.case is None:  # one process per case (see part 1)
        cases = [_child_case(i, args, env) for i in range(4)]
        bad = [c for c in cases if "error" in c]
        if bad:
            return bad[0]
        first = cases[0]
        first["cases"] = [c["cases"][0] for c in cases]
        return first
    return _run_child(part, args, env)


def _child_case(i, args, env):
    env = dict(env)
    if not args.dry_run:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
    args = argparse.Namespace(**{**vars(args), "case": i})
    return _run_child("schedule", args, env)


def _run_child(part, args, env):
    if args.dry_run:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    cmd = [sys.executable, os.path.abspath(__file__), "--part", part, "--out", args.out,
           "--steps", str(args.steps)] + (["--dry-run"] if args.dry_run else []) + (
               [] if args.case is None else ["--case", str(args.case)])
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                           timeout=args.timeout)
    except subprocess.TimeoutExpired as e:
        tail = ((e.stdout or b"").decode(errors="replace")
                + (e.stderr or b"").decode(errors="replace"))
        return {"error": f"part {part} timed out after {args.timeout} s", "tail": tail[-6000:]}
    sys.stderr.write(p.stderr[-6000:] if p.returncode else "")
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("PART_JSON ")]
    if p.returncode or not line:
        return {"error": f"part {part} exited {p.returncode}",
                "tail": (p.stdout + p.stderr)[-2500:]}
    res = json.loads(line[-1][len("PART_JSON "):])
    res["wall_s"] = time.perf_counter() - t
    return res


def run_part(args):
    if args.part == "schedule":
        import faulthandler

        faulthandler.dump_traceback_later(max(args.timeout - 10, 5), exit=True)
        if not args.dry_run:
            import jax

            jax.config.update("mock_num_gpu_processes", 8)
        s, texts = schedule_part(args.dry_run, args.case)
        for i, (label, text) in texts.items():  # one file per case, named by its index
            with open(os.path.join(args.out, f"schedule_{i}.hlo.txt"), "w") as f:
                f.write(f"// {label}\n{text}")
        res = s
    elif args.part == "timing":
        res = {"jax": jax_timing(args.steps, args.dry_run),
               "torch": torch_timing(args.steps, args.dry_run)}
    else:
        res = nccl_part(args.out, args.dry_run)
    print("PART_JSON " + json.dumps(res, default=str), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, ".tmp", "gpu-out"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dry-run", action="store_true", help="XLA:CPU, to check the script")
    ap.add_argument("--part", choices=("schedule", "timing", "nccl"))
    ap.add_argument("--parts", default="schedule,timing,nccl")
    ap.add_argument("--case", type=int, help="schedule part: compile only case CASE (0-3)")
    ap.add_argument("--timeout", type=float, default=240)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    sys.path.insert(0, ROOT)
    if args.part:
        return run_part(args)
    if args.dry_run:
        args.steps = min(args.steps, 3)
    res = {}
    for part in args.parts.split(","):
        res[part] = _child(part, args)
        if "error" in res[part]:
            print(f"({part}) FAILED: {res[part]['error']}\n{res[part]['tail']}")
        elif part == "schedule":
            print_schedule(res[part])
        elif part == "timing":
            print_timing(res[part]["jax"], res[part]["torch"])
        else:
            r = res[part]
            print(f"(3) 2 processes on one GPU, NCCL all_reduce: exit {r['rc']} after "
                  f"{r['seconds']:.1f} s")
            for ln in r["lines"]:
                print("     " + ln[:300])
        sys.stdout.flush()
    with open(os.path.join(args.out, "gpu.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    print("GPU_JSON " + json.dumps(res, default=str))


if __name__ == "__main__":
    main()
