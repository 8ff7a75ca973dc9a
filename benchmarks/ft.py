"""jdist.ft: what fault tolerance costs per step, and what a lost replica costs.

(a) **Overhead when nothing fails**: 2 replicas (processes, one thread each) train an
    MLP 784-1024-1024-10 with Adam, batch 64 per replica. jdist.ft's step (quorum on
    the launcher's store, the gradients' weighted mean over its own sockets, the vote)
    against jdist's DDP ``train_step`` (gradients all-reduced by XLA's gloo inside the
    compiled step) in the same run, ABBA twice, each side's best median ms per step.
    Goal: <= 1.05x.
(b) **From a kill to the next committed step**: rank 1 gets SIGKILL at step 20. With
    ``jdist-run --ft`` the survivor goes on alone after its heartbeat deadline (2 s);
    its first step committed without the dead replica is timed, and so is the
    replacement's first committed step (it healed from the survivor). The baseline is the restart
    jdist-run does without ``--ft`` (``--max-restarts 1``, the attempts share a JAX
    compilation cache): every process starts again, imports, initialises and
    compiles; timed to the restarted job's first step (without even restoring a
    checkpoint). Goal: <= 10 s.

    python benchmarks/ft.py            # 150 steps per variant in (a)
    python benchmarks/ft.py --quick    # 40
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

BATCH, SIZES = 64, (784, 1024, 1024, 10)


def _model():
    import optax
    from flax import nnx

    r = nnx.Rngs(0)
    layers = []
    for a, b in zip(SIZES, SIZES[1:], strict=False):
        layers += [nnx.Linear(a, b, rngs=r), nnx.relu]
    model = nnx.Sequential(*layers[:-1])
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def _loss(model, batch):
    import optax

    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def _batch(rank: int, step: int):
    import numpy as np

    rng = np.random.RandomState(1000 * step + rank)
    return {"x": rng.randn(BATCH, SIZES[0]).astype(np.float32),
            "y": rng.randint(0, SIZES[-1], BATCH).astype(np.int32)}


def _record(out: str, tag: str, step: int, quorum: str = "-") -> None:
    if step == 1 or not os.path.exists(os.path.join(out, f"{tag}.pid")):
        with open(os.path.join(out, f"{tag}.pid"), "w") as f:
            f.write(str(os.getpid()))
    with open(os.path.join(out, f"{tag}.txt"), "a") as f:
        f.write(f"{step} {time.time():.6f} {quorum}\n")


def worker_ft(args) -> None:
    import jax

    from jdist import ft

    manager = ft.Manager(heartbeat_timeout=2.0, timeout=30.0)
    model, opt = _model()
    ddp, optimizer = ft.DistributedDataParallel(manager, model), ft.Optimizer(manager, opt)
    step_fn = ddp.value_and_grad(_loss)
    tag = f"ft_{manager.replica_id}_{manager.incarnation}"
    while True:
        q = optimizer.zero_grad()
        if manager.current_step() >= args.steps:
            break
        loss, grads = step_fn(_batch(q.rank(manager.replica_id), manager.current_step()))
        if optimizer.step(ddp.module, grads):
            jax.block_until_ready(loss)
            _record(args.out, tag, manager.current_step(),  # (members, incarnations)
                    ",".join(f"{m}.{i}" for m, i in sorted(q.incarnations.items())))
    manager.finish()


def worker_ddp(args) -> None:
    import jax

    import jdist
    from jdist.ddp import DistributedDataParallel

    jdist.init_process_group("gloo")
    rank, attempt = jdist.get_rank(), os.environ.get("JDIST_RESTART_COUNT", "0")
    model, opt = _model()
    ddp = DistributedDataParallel(model)
    step = ddp.train_step(_loss, opt)
    for s in range(1, args.steps + 1):
        jax.block_until_ready(step(_batch(rank, s)))
        _record(args.out, f"ddp_{rank}_{attempt}", s)
    jdist.destroy_process_group()


def _launch(out: str, mode: str, steps: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jdist.launch", "--nproc-per-node", "2", *extra,
           os.path.abspath(__file__), "--worker", mode, "--out", out, "--steps", str(steps)]
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(os.path.join(out, "launcher.log"), "ab"))


def _times(out: str, pattern: str, without: str | None = None) -> list[tuple[int, float]]:
    """(step, time) of the records matching ``pattern`` (with ``without``: only steps
    whose quorum did not have that replica incarnation, e.g. ``"1.0"``)."""
    rows = []
    for path in glob.glob(os.path.join(out, pattern)):
        with open(path) as f:
            for line in f:
                step, t, quorum = line.split()
                if without is None or without not in quorum.split(","):
                    rows.append((int(step), float(t)))
    return sorted(rows)


def _median_step_ms(out: str, pattern: str, skip: int) -> float:
    times = [t for s, t in _times(out, pattern) if s > skip]
    return 1e3 * statistics.median(b - a for a, b in zip(times, times[1:], strict=False))


def overhead(steps: int, repeats: int = 2) -> tuple[float, float]:
    """(a): median step ms of DDP and of ft, each a fresh 2-process job; the jobs run
    in ABBA order ``repeats`` times and each side keeps its best median (this machine's
    speed drifts by a third between minutes: one job each would compare the drift)."""
    best = {"ddp": float("inf"), "ft": float("inf")}
    order = [("ddp", []), ("ft", ["--ft"])]
    for i in range(repeats):
        for mode, extra in order if i % 2 == 0 else order[::-1]:
            with tempfile.TemporaryDirectory() as out:
                job = _launch(out, mode, steps, extra)
                if job.wait(600) != 0:
                    raise SystemExit(f"{mode} job failed: "
                                     f"{open(out + '/launcher.log').read()}")
                best[mode] = min(best[mode], _median_step_ms(out, f"{mode}_0_0.txt", 5))
    return best["ddp"], best["ft"]


def _kill_at(out: str, tag: str, step: int, job: subprocess.Popen) -> float:
    """SIGKILL the worker that records ``tag`` once it recorded ``step``; the time."""
    while not any(s >= step for s, _ in _times(out, f"{tag}.txt")):
        if job.poll() is not None:
            raise SystemExit(f"job ended early: {open(out + '/launcher.log').read()}")
        time.sleep(0.01)
    with open(os.path.join(out, f"{tag}.pid")) as f:
        os.kill(int(f.read()), signal.SIGKILL)
    return time.time()


def recovery(steps: int) -> dict[str, float]:
    """(b): seconds from the kill to the next step (ft survivor, ft replacement,
    restart)."""
    found = {}
    with tempfile.TemporaryDirectory() as out:
        job = _launch(out, "ft", steps, ["--ft", "--max-restarts", "1"])
        killed = _kill_at(out, "ft_1_0", 20, job)
        job.wait(600)
        after = [t for _, t in _times(out, "ft_0_0.txt", without="1.0") if t > killed]
        replaced = [t for _, t in _times(out, "ft_*_1.txt")]
        found["ft: next committed step (survivor)"] = min(after) - killed
        found["ft: replacement's first committed step"] = min(replaced) - killed
    with tempfile.TemporaryDirectory() as out:
        job = _launch(out, "ddp", steps, ["--max-restarts", "1"])
        killed = _kill_at(out, "ddp_1_0", 20, job)
        job.wait(600)
        found["restart: first step of the new attempt"] = min(
            t for _, t in _times(out, "ddp_*_1.txt")) - killed
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--quick", action="store_true", help="40 steps per variant")
    ap.add_argument("--worker", choices=("ft", "ddp"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        (worker_ft if args.worker == "ft" else worker_ddp)(args)
        return
    steps = 40 if args.quick else args.steps
    from benchmarks._parse import bench_json, row, table

    ddp_ms, ft_ms = overhead(steps)
    print(f"(a) step, 2 replicas, MLP {'-'.join(map(str, SIZES))}, batch {BATCH} each")
    print(f"  jdist DDP (XLA gloo in the step)   {ddp_ms:8.2f} ms")
    print(f"  jdist.ft                           {ft_ms:8.2f} ms   ratio {ft_ms / ddp_ms:.3f}x")
    rec = recovery(max(steps, 60))
    restart = rec["restart: first step of the new attempt"]
    print("(b) seconds from SIGKILL of rank 1 to the next step")
    for name, seconds in rec.items():
        print(f"  {name:42s} {seconds:6.2f} s   vs restart {seconds / restart:.2f}x")
    print(bench_json("ft", [
        table("step time when nothing fails, 2 replicas", "jdist DDP", "ft / DDP",
              [row("MLP step", "ms", ft_ms, ddp_ms, ft_ms / ddp_ms)]),
        table("from a kill to the next step", "restart (--max-restarts 1)",
              "ft / restart", [row(n, "s", v, restart, v / restart)
                               for n, v in rec.items() if not n.startswith("restart")])]))


if __name__ == "__main__":
    main()
