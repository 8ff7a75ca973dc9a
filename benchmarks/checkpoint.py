"""Checkpoint costs: async saving every 50 steps, and a restart to the first resumed step.

(a) Step time of DDP training of benchmarks/ddp.py's MLP (784-1024x3-10, Adam, batch
    128, one process with ``--devices`` virtual devices) with a
    ``jdist.checkpoint.CheckpointManager`` saving model, optimizer, sampler and step
    every 50 steps, against the same loop without checkpoints (the baseline), measured
    in the same run: mean ms per step over all steps, save steps included. Both loops
    run ``--rounds`` times, alternating, and the best round of each counts. Goal:
    async saving costs at most 5%. A synchronous manager is shown for comparison.
(b) Time from a restart to the first resumed step: a fresh process (imports, DDP set-up,
    compile) that restores the newest checkpoint and takes one step, against the same
    process on an empty directory (a first launch: ``init()`` and one step).

    python benchmarks/checkpoint.py            # 300 steps per loop, 3 rounds
    python benchmarks/checkpoint.py --quick    # 100 steps, 1 round
"""

from __future__ import annotations

import argparse
import json
import os
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


def _loop(state, step_fn, batches, steps: int, manager=None) -> float:
    """Mean ms per step over ``steps`` steps."""
    it = iter(state["sampler"])
    start = time.perf_counter()
    for i in range(steps):
        for _ in range(BATCH):
            next(it)
        float(step_fn(batches[i % 4]))  # the loss read back, as a training loop logs it
        state["step"] += 1
        if manager is not None:
            manager.save(state["step"], state)
    if manager is not None:
        manager.wait()  # the last write counts too
    return 1e3 * (time.perf_counter() - start) / steps


def overhead(steps: int, rounds: int) -> dict:
    """Best mean step time of each variant, alternating, on one compiled DDP step."""
    from benchmarks.ddp import batch, loss_fn
    from jdist.checkpoint import CheckpointManager

    state = _init()
    step_fn = state["ddp"].train_step(loss_fn, state["optimizer"])
    batches = [batch("mlp", BATCH, seed=s) for s in range(4)]
    for i in range(3):  # compile and warm up
        step_fn(batches[i])
    best = {"none": float("inf"), "async": float("inf"), "sync": float("inf")}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for kind in ("none", "async", "sync"):
                state["step"] = 0
                state["sampler"].set_epoch(r * 3 + len(kind))  # a fresh pass each loop
                manager = None if kind == "none" else CheckpointManager(
                    os.path.join(tmp, f"{kind}{r}"), save_interval_steps=INTERVAL,
                    max_to_keep=1, async_save=kind == "async")
                best[kind] = min(best[kind], _loop(state, step_fn, batches, steps, manager))
                if manager is not None:
                    manager.close()
    return {**best, "saves": steps // INTERVAL}


def first_step(directory: str) -> None:
    """One process: restore (or init) and take one step; prints seconds since start."""
    from benchmarks.ddp import batch, loss_fn
    from jdist.checkpoint import CheckpointManager

    manager = CheckpointManager(directory, save_interval_steps=INTERVAL)
    state = manager.restore_or_init(_init)
    restored = time.perf_counter() - T0
    step_fn = state["ddp"].train_step(loss_fn, state["optimizer"])
    float(step_fn(batch("mlp", BATCH)))
    state["step"] += 1
    done = time.perf_counter() - T0
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="100 steps, 1 round")
    ap.add_argument("--first-step", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    _setup(args.devices)
    if args.first_step:
        first_step(args.first_step)
        return
    if args.quick:
        args.steps, args.rounds = 100, 1
    from benchmarks._parse import bench_json, row, table

    o = overhead(args.steps, args.rounds)
    print(f"(a) DDP MLP 784-1024x3-10, Adam, batch {BATCH}, {args.devices} devices, "
          f"{args.steps} steps, a save every {INTERVAL} ({o['saves']} saves), best of "
          f"{args.rounds}")
    print(f"  no checkpoints               {o['none']:8.2f} ms/step")
    print(f"  async save every {INTERVAL}          {o['async']:8.2f} ms/step   "
          f"ratio {o['async'] / o['none']:.3f}x   (goal <= 1.05x)")
    print(f"  sync save every {INTERVAL}           {o['sync']:8.2f} ms/step   "
          f"ratio {o['sync'] / o['none']:.3f}x")
    r = restart(args.devices)
    f, s = r["fresh"], r["resumed"]
    print("(b) a new process to its first step (imports, DDP set-up, compile included)")
    print(f"  first launch (init)          {f['first_step_s']:8.2f} s   (state ready at "
          f"{f['ready_s']:.2f} s)")
    print(f"  restart (restore step {INTERVAL})     {s['first_step_s']:8.2f} s   (state ready "
          f"at {s['ready_s']:.2f} s)   ratio {s['first_step_s'] / f['first_step_s']:.3f}x")
    print(bench_json("checkpoint", [
        table("Step time with checkpoints every 50 steps (DDP MLP)", "no checkpoints",
              "jdist / no checkpoints",
              [row("async save", "ms/step", o["async"], o["none"], o["async"] / o["none"],
                   "goal <= 1.05"),
               row("sync save", "ms/step", o["sync"], o["none"], o["sync"] / o["none"])]),
        table("A new process to its first step", "first launch", "restart / first launch",
              [row("restart, restore + first step", "s", s["first_step_s"],
                   f["first_step_s"], s["first_step_s"] / f["first_step_s"]),
               row("restart, state ready", "s", s["ready_s"], f["ready_s"],
                   s["ready_s"] / f["ready_s"])]),
    ]))


if __name__ == "__main__":
    main()
