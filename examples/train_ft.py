"""Training that survives lost replicas (jdist.ft): kill any worker, the rest go on.

Each worker is one replica of an MLP regression with Adam. Every step forms a quorum
of the live replicas, averages their gradients (weighted by samples), and commits only
if all of them succeeded; `jdist-run --ft` replaces a worker that dies, and the
replacement heals parameters, optimizer state and the data position from a live peer.
Every committed step's samples go to a ledger: each sample of an epoch is used once.

    jdist-run --ft --nproc-per-node 4 --max-restarts 3 examples/train_ft.py --out /tmp/ft
    (in another shell: kill -9 one of the workers; watch the others go on)
    python examples/train_ft.py --replay /tmp/ft    # same steps, one process: same bits
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import numpy as np

SAMPLES, FEATURES, BATCH = 96, 8, 4


def _data():
    rng = np.random.RandomState(0)
    x = rng.randn(SAMPLES, FEATURES).astype(np.float32)
    y = (x @ rng.randn(FEATURES, 1) + 0.1 * rng.randn(SAMPLES, 1)).astype(np.float32)
    return x, y


def _build(manager):
    import optax
    from flax import nnx

    from jdist import ft

    model = nnx.Sequential(nnx.Linear(FEATURES, 32, rngs=nnx.Rngs(0)), nnx.relu,
                           nnx.Linear(32, 1, rngs=nnx.Rngs(1)))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    return ft.DistributedDataParallel(manager, model), ft.Optimizer(manager, optimizer)


def _loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def _save(path: str, model) -> None:
    import jax
    from flax import nnx

    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    np.savez(path, *[np.asarray(x) for x in leaves])


def train(args) -> int:
    from jdist import ft
    from jdist.errors import JobFinishedError

    manager = ft.Manager(timeout=args.timeout, heartbeat_timeout=args.heartbeat_timeout)
    rank, inc = manager.replica_id, manager.incarnation
    ddp, optimizer = _build(manager)
    x, y = _data()
    os.makedirs(args.out, exist_ok=True)
    sampler = ft.DistributedSampler(manager, SAMPLES, BATCH, seed=0,
                                    ledger=os.path.join(args.out, f"ledger_{rank}_{inc}.jsonl"))
    step_fn = ddp.value_and_grad(_loss)
    with open(os.path.join(args.out, f"pid_{rank}_{inc}"), "w") as f:
        json.dump({"pid": os.getpid(), "env": {k: os.environ.get(k, "") for k in
                                               ("XLA_FLAGS", "OMP_NUM_THREADS")}}, f)
    while True:
        if args.stop_file and os.path.exists(args.stop_file):
            manager.request_stop()
        try:
            q = optimizer.zero_grad()
        except JobFinishedError as e:
            print(f"replica {rank}: {e}")
            manager.close()
            return 0
        if q.stop or manager.current_step() >= args.steps:
            break
        idx = sampler.indices()
        loss, grads = step_fn({"x": x[idx], "y": y[idx]})
        time.sleep(args.sleep)  # stands in for a longer computation
        if optimizer.step(ddp.module, grads) and manager.current_step() % args.every == 0:
            print(f"step {manager.current_step()} epoch {sampler.epoch} loss "
                  f"{float(loss):.4f} replicas {len(q.members)}", flush=True)
    manager.finish()
    _save(os.path.join(args.out, f"final_{rank}.npz"), ddp.module)
    with open(os.path.join(args.out, f"result_{rank}.json"), "w") as f:
        json.dump({"pid": os.getpid(), "incarnation": inc, "step": manager.current_step()}, f)
    print(f"replica {rank} finished at step {manager.current_step()}")
    return 0


def _steps(out: str) -> dict[int, dict]:
    """One ledger record per committed step (any member's: they agree)."""
    steps: dict[int, dict] = {}
    for path in sorted(glob.glob(os.path.join(out, "ledger_*.jsonl"))):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                steps.setdefault(rec["step"], rec)
    return steps


def replay(args) -> int:
    """Replay the ledger's membership sequence in this one process."""
    import jax
    import jax.numpy as jnp

    from jdist import ft

    ddp, optimizer = _build(None)
    sampler = ft.DistributedSampler(None, SAMPLES, BATCH, seed=0)
    local = ddp.local_value_and_grad(_loss)
    x, y = _data()
    steps = _steps(args.replay)
    for s in range(1, max(steps) + 1):
        rec = steps[s]
        sampler.load_state_dict(rec)
        parts, counts, treedef = [], [], None
        for i in range(len(rec["members"])):
            idx = sampler.take(len(rec["members"]), i)
            _, grads = local(ddp.module, {"x": x[idx], "y": y[idx]})
            leaves, treedef = jax.tree.flatten(grads)
            parts.append([ft.to_numpy(g) for g in leaves])
            counts.append(len(idx))
        mean = ft.weighted_mean(parts, counts)
        optimizer.apply(ddp.module, jax.tree.unflatten(treedef, [jnp.asarray(m) for m in mean]))
    _save(os.path.join(args.replay, "replay.npz"), ddp.module)
    print(f"replayed {max(steps)} steps")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/jdist-ft", help="ledgers and final parameters")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sleep", type=float, default=0.02, help="extra seconds per step")
    ap.add_argument("--every", type=int, default=20, help="print every N steps")
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--heartbeat-timeout", type=float, default=2.0)
    ap.add_argument("--stop-file", default=None, help="stop every replica once it exists")
    ap.add_argument("--replay", default=None, metavar="OUT",
                    help="replay OUT's ledger in one process instead of training")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return replay(args) if args.replay else train(args)


if __name__ == "__main__":
    sys.exit(main())
