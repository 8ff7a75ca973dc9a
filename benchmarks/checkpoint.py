"""Checkpoint costs: async saving every 50 steps, and a restart to the first resumed step.

(a) Step time of DDP training of benchmarks/ddp.py's MLP (784-1024x3-10, Adam, batch
    128, one process with ``--devices`` virtual devices) with a
    ``jdist.checkpoint.CheckpointManager`` saving model, optimizer, sampler and step
    every 50 steps, against the same loop without checkpoints (the baseline), measured
    in the same run on the same compiled step: mean ms per step over one interval of
    50 steps (its save, and the wait for its write, included), the variants
    alternating interval by interval (ABC, CBA, ...). The ratio is the median over
    ``--rounds`` rounds of each round's own ratio (a variant against the baseline
    interval next to it: a shared machine's load drifts less within a round than
    over the run); the ratio of the medians is printed beside it. Wall time is what
    a training loop sees; CPU time (this process, all threads) is the work a save adds
    and depends less on other load. The load average is printed with the numbers.
    Goal: async saving costs at most 5%. A synchronous manager is shown for comparison.
    The same intervals are also read against their own typical step: the time an
    interval spends above ``INTERVAL`` times its median step, less the same excess of
    the round's baseline interval (step times are skewed, so a baseline interval has
    some too), as a ratio ``1 + excess``, median over rounds. That reading does not move
    with the machine's speed from one interval to the next, which on a shared machine
    is most of the spread of the plain ratio.
(b) Time from a restart to the first resumed step: a fresh process (imports, DDP set-up,
    compile) that restores the newest checkpoint and takes one step, against the same
    process on an empty directory (a first launch: ``init()`` and one step).
(c) The same under ``jdist-run --max-restarts 1``: the first attempt takes a step,
    saves and exits with an error; the time from that exit to the restarted worker's
    restored state and first step. The baseline is what torchrun does, a fresh
    interpreter that compiles everything again (``--no-compilation-cache``); against it
    jdist-run's default (the attempts share a JAX compilation cache) and that with
    ``--start-method forkserver`` (workers forked from a server that imported JAX, Flax,
    Optax and jdist once).

    python benchmarks/checkpoint.py            # 16 intervals of 50 steps per variant
    python benchmarks/checkpoint.py --quick    # 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

T0 = time.perf_counter()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

BATCH = 128
INTERVAL = 50


def _setup(devices: int) -> None:
    from jdist.launch import xla_flags_with_devices  # imports no JAX

    os.environ["XLA_FLAGS"] = xla_flags_with_devices(os.environ.get("XLA_FLAGS", ""), devices)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _init():
    import optax
    from flax import nnx

    from benchmarks.ddp import nnx_model
    from jdist.ddp import DistributedDataParallel
    from jdist.sampler import DistributedSampler

    ddp = DistributedDataParallel(nnx_model("mlp"))
    opt = nnx.Optimizer(ddp.module, optax.adam(1e-3), wrt=nnx.Param)
    return {"ddp": ddp, "optimizer": opt, "sampler": DistributedSampler(10**6, 1, 0),
            "step": 0}


def _block(state, step_fn, batches, it, manager=None) -> tuple[float, float, float]:
    """Mean wall and CPU (this process, all threads) ms per step over one save interval
    (a save at its first step), and the interval's excess over its own median step:
    ``(sum of step times - INTERVAL * median step) / (INTERVAL * median step)``."""
    start, cpu = time.perf_counter(), time.process_time()
    steps = []
    for i in range(INTERVAL):
        t = time.perf_counter()
        for _ in range(BATCH):
            next(it)
        float(step_fn(batches[i % 4]))  # the loss read back, as a training loop logs it
        state["step"] += 1
        if manager is not None and i == 0:
            manager.save(state["step"], state, force=True)
        steps.append(time.perf_counter() - t)
    if manager is not None:
        t = time.perf_counter()
        manager.wait()  # the write counts too (it normally ended long before)
        steps[-1] += time.perf_counter() - t
    typical = INTERVAL * statistics.median(steps)
    return (1e3 * (time.perf_counter() - start) / INTERVAL,
            1e3 * (time.process_time() - cpu) / INTERVAL,
            (sum(steps) - typical) / typical)


def overhead(rounds: int) -> dict:
    """Step times of each variant, one interval per variant per round, the order
    alternating between rounds, on one compiled DDP step: the medians, and the median
    of the per-round ratios to the baseline."""
    from benchmarks.ddp import batch, loss_fn
    from jdist.checkpoint import CheckpointManager

    state = _init()
    step_fn = state["ddp"].train_step(loss_fn, state["optimizer"])
    batches = [batch("mlp", BATCH, seed=s) for s in range(4)]
    for i in range(3):  # compile and warm up
        step_fn(batches[i])
    times: dict = {"none": [], "async": [], "sync": []}
    it = iter(state["sampler"])
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        managers = {k: CheckpointManager(os.path.join(tmp, k), save_interval_steps=INTERVAL,
                                         max_to_keep=1, async_save=k == "async")
                    for k in ("async", "sync")}
        for m in managers.values():  # the first save of each opens Orbax's machinery
            m.save(0, state, force=True)
            m.wait()
        for r in range(rounds):
            order = ("none", "async", "sync") if r % 2 == 0 else ("sync", "async", "none")
            for kind in order:
                times[kind].append(_block(state, step_fn, batches, it, managers.get(kind)))
        for m in managers.values():
            m.close()
    load.append(os.getloadavg()[0])
    out: dict = {"load": load}
    for k, v in times.items():
        out[k] = statistics.median(w for w, _, _ in v)
        out[f"{k}_cpu"] = statistics.median(c for _, c, _ in v)
    for k in ("async", "sync"):
        pairs = list(zip(times[k], times["none"], strict=True))
        out[f"{k}_ratio"] = statistics.median(a[0] / b[0] for a, b in pairs)
        out[f"{k}_cpu_ratio"] = statistics.median(a[1] / b[1] for a, b in pairs)
        # the save's own cost: the interval's excess over its median step, less the
        # baseline interval's excess of the same round (skewed step times give every
        # interval some); free of the drift of the machine's speed between intervals
        out[f"{k}_excess"] = 1 + statistics.median(a[2] - b[2] for a, b in pairs)
    return out


def _restore_and_step(directory: str, clock) -> tuple:
    """``(manager, state, ready, done)``: restore (or init) the state in ``directory``
    and take one step; ``clock()`` read when the state is ready and after the step."""
    from benchmarks.ddp import batch, loss_fn
    from jdist.checkpoint import CheckpointManager

    manager = CheckpointManager(directory, save_interval_steps=INTERVAL)
    state = manager.restore_or_init(_init)
    ready = clock()
    step_fn = state["ddp"].train_step(loss_fn, state["optimizer"])
    float(step_fn(batch("mlp", BATCH)))
    state["step"] += 1
    return manager, state, ready, clock()


def first_step(directory: str) -> None:
    """One process: restore (or init) and take one step; prints seconds since start."""
    manager, state, restored, done = _restore_and_step(
        directory, lambda: time.perf_counter() - T0)
    if manager.restored_step is None:  # leave a checkpoint for the resumed run
        manager.save(INTERVAL, state, force=True)
    manager.close()
    print(json.dumps({"restored_step": manager.restored_step, "ready_s": restored,
                      "first_step_s": done}))


def restart(devices: int) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("fresh", "resumed"):
            res = subprocess.run([sys.executable, __file__, "--devices", str(devices),
                                  "--first-step", tmp], capture_output=True, text=True,
                                 env=env, timeout=600)
            if res.returncode:
                raise SystemExit(f"the {kind} run failed:\n{res.stderr[-3000:]}")
            out[kind] = json.loads(res.stdout.strip().splitlines()[-1])
    if out["resumed"]["restored_step"] != INTERVAL:
        raise SystemExit(f"the resumed run did not restore step {INTERVAL}: {out}")
    return out


def relaunch_worker(directory: str) -> None:
    """A jdist-run worker: attempt 0 saves step INTERVAL and fails, attempt 1 restores it
    and takes a step; each writes its times (``time.time()``) to ``directory``."""
    manager, state, ready, done = _restore_and_step(os.path.join(directory, "ck"), time.time)
    if int(os.environ["JDIST_RESTART_COUNT"]) == 0:
        manager.save(INTERVAL, state, force=True)
        manager.close()
        with open(os.path.join(directory, "exit.json"), "w") as f:
            json.dump({"exit": time.time()}, f)
        sys.exit(1)  # a failure after a checkpoint: jdist-run restarts the job
    manager.close()
    with open(os.path.join(directory, "resumed.json"), "w") as f:
        json.dump({"restored_step": manager.restored_step, "ready": ready, "done": done}, f)


_PRELOAD = "jax,jax.numpy,numpy,flax.nnx,optax,jdist.ddp,jdist.sampler,jdist.checkpoint"


RESTARTS = {  # (c): label -> jdist-run flags
    "fresh interpreter, no cache": ["--start-method", "spawn", "--no-compilation-cache"],
    "default (shared compilation cache)": ["--start-method", "spawn"],
    "--start-method forkserver": ["--start-method", "forkserver",
                                  "--forkserver-preload", _PRELOAD],
}


def restart_under_launcher(devices: int, flags: list[str]) -> dict:
    """(c): seconds from the failed attempt's exit to the restarted worker's restored
    state (``ready_s``) and first step (``first_step_s``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")
           and k != "JAX_COMPILATION_CACHE_DIR"}
    env["PYTHONPATH"] = ROOT
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "jdist.launch", "--nproc-per-node", "1",
               "--devices-per-proc", str(devices), "--max-restarts", "1", *flags,
               __file__, "--devices", str(devices), "--relaunch", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if res.returncode:
            raise SystemExit(f"jdist-run {flags} failed:\n{res.stderr[-3000:]}")
        with open(os.path.join(tmp, "exit.json")) as f:
            gone = json.load(f)["exit"]
        with open(os.path.join(tmp, "resumed.json")) as f:
            back = json.load(f)
    if back["restored_step"] != INTERVAL:
        raise SystemExit(f"jdist-run {flags} did not restore step {INTERVAL}: {back}")
    return {"ready_s": back["ready"] - gone, "first_step_s": back["done"] - gone}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=16,
                    help="rounds of one save interval per variant")
    ap.add_argument("--quick", action="store_true", help="3 rounds")
    ap.add_argument("--first-step", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--relaunch", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    _setup(args.devices)
    if args.first_step:
        first_step(args.first_step)
        return
    if args.relaunch:
        relaunch_worker(args.relaunch)
        return
    if args.quick:
        args.rounds = 3
    from benchmarks._parse import bench_json, row, table

    o = overhead(args.rounds)
    print(f"(a) DDP MLP 784-1024x3-10, Adam, batch {BATCH}, {args.devices} devices, a save "
          f"every {INTERVAL} steps; {args.rounds} rounds of one interval per variant; load "
          f"average {o['load'][0]:.2f} at the start, {o['load'][1]:.2f} at the end")
    print("  wall ms/step (what a loop sees; on a busy machine mostly other load) and CPU "
          "ms/step (this process's work, all threads): medians; ratio: median of the "
          "rounds' ratios (ratio of the medians in brackets)")
    print(f"  {'no checkpoints':<29}{o['none']:8.2f} ms/step   CPU "
          f"{o['none_cpu']:8.2f} ms/step")
    for kind, goal in (("async", "   (goal <= 1.05x)"), ("sync", "")):
        print(f"  {kind + ' save every ' + str(INTERVAL):<29}{o[kind]:8.2f} ms/step   "
              f"CPU {o[kind + '_cpu']:8.2f} ms/step   ratio {o[kind + '_ratio']:.3f}x "
              f"({o[kind] / o['none']:.3f}x)   CPU ratio {o[kind + '_cpu_ratio']:.3f}x "
              f"({o[kind + '_cpu'] / o['none_cpu']:.3f}x){goal}")
    print("  against each interval's own median step (the excess over it, less the "
          "baseline interval's of the round; median of the rounds):")
    for kind, goal in (("async", "   (goal <= 1.05x)"), ("sync", "")):
        print(f"  {kind + ' save every ' + str(INTERVAL):<29}ratio "
              f"{o[kind + '_excess']:.3f}x{goal}")
    r = restart(args.devices)
    f, s = r["fresh"], r["resumed"]
    print("(b) a new process to its first step (imports, DDP set-up, compile included)")
    print(f"  first launch (init)          {f['first_step_s']:8.2f} s   (state ready at "
          f"{f['ready_s']:.2f} s)")
    print(f"  restart (restore step {INTERVAL})     {s['first_step_s']:8.2f} s   (state ready "
          f"at {s['ready_s']:.2f} s)   ratio {s['first_step_s'] / f['first_step_s']:.3f}x")
    launched = {k: restart_under_launcher(args.devices, v) for k, v in RESTARTS.items()}
    base = launched["fresh interpreter, no cache"]
    print("(c) jdist-run --max-restarts 1: from the failed attempt's exit to the restarted "
          "worker's first step")
    for label, r in launched.items():
        print(f"  {label:<37}{r['first_step_s']:8.2f} s   (state ready at "
              f"{r['ready_s']:.2f} s)   ratio {r['first_step_s'] / base['first_step_s']:.3f}x")
    paired = (f"ratio: median of {args.rounds} rounds' ratios; load average "
              f"{o['load'][0]:.1f}-{o['load'][1]:.1f}")
    local = (f"1 + the interval's excess over its median step less the baseline's; "
             f"median of {args.rounds} rounds")
    print(bench_json("checkpoint", [
        table("Step time with checkpoints every 50 steps (DDP MLP)", "no checkpoints",
              "jdist / no checkpoints",
              [row("async save", "ms/step", o["async"], o["none"], o["async_ratio"],
                   "goal <= 1.05; " + paired),
               row("sync save", "ms/step", o["sync"], o["none"], o["sync_ratio"], paired),
               row("async save, CPU time", "ms/step", o["async_cpu"], o["none_cpu"],
                   o["async_cpu_ratio"], "goal <= 1.05; " + paired),
               row("sync save, CPU time", "ms/step", o["sync_cpu"], o["none_cpu"],
                   o["sync_cpu_ratio"], paired),
               row("async save, against the interval's own median step", "ms/step",
                   o["none"] * o["async_excess"], o["none"], o["async_excess"],
                   "goal <= 1.05; " + local),
               row("sync save, against the interval's own median step", "ms/step",
                   o["none"] * o["sync_excess"], o["none"], o["sync_excess"], local)]),
        table("A new process to its first step", "first launch", "restart / first launch",
              [row("restart, restore + first step", "s", s["first_step_s"],
                   f["first_step_s"], s["first_step_s"] / f["first_step_s"]),
               row("restart, state ready", "s", s["ready_s"], f["ready_s"],
                   s["ready_s"] / f["ready_s"])]),
        table("jdist-run --max-restarts 1: a failed attempt's exit to the restarted "
              "worker's first step", "fresh interpreter, no cache (as torchrun)",
              "jdist / fresh interpreter",
              [row(f"{what}, {label}", "s", launched[label][key], base[key],
                   launched[label][key] / base[key])
               for label in list(RESTARTS)[1:]
               for what, key in (("first resumed step", "first_step_s"),
                                 ("state restored", "ready_s"))]),
    ]))


if __name__ == "__main__":
    main()
