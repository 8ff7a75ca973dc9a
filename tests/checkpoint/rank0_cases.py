"""The ranks' side of ``test_rank0_save.py`` (imported by the spawned processes only).

One launch of 2 processes runs every case of the grid {save on every rank, on rank 0
only, on rank 1 only} x {replicated values only, plus a sampler, plus an array sharded
over both processes} x {sync, async}: each rank records what its save did (and how
long it took) and what a restore on every rank then gave, and after each case a save
on every rank and a restore check that nothing was left waiting.
"""

from __future__ import annotations

import os
import time

import numpy as np

PEER_TIMEOUT = 1.5
WHO = ("all", 0, 1)
STATES = ("replicated", "sampler", "sharded")


def _state(kind: str, rank: int, fill: float) -> dict:
    """The state of one case: the same replicated values on every rank, JSON data,
    and (``sampler``/``sharded``) a value that differs between the processes."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from jdist.sampler import DistributedSampler

    mesh = jax.make_mesh((2,), ("p",), devices=jax.devices())
    lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    lin.kernel.value = lin.kernel.value * 0 + fill
    glob = jax.device_put(np.full((4,), fill, np.float32), NamedSharding(mesh, PartitionSpec()))
    st = {"model": lin, "w": np.arange(5.0) * fill, "glob": glob, "epoch": int(fill)}
    if kind == "sampler":
        s = DistributedSampler(20, num_replicas=2, rank=rank, seed=1)
        s.set_epoch(int(fill))
        it = iter(s)
        for _ in range(rank + 1):  # positions differ per rank
            next(it)
        st["sampler"] = s
    if kind == "sharded":
        local = np.full((1, 3), fill + rank, np.float32)
        st["shard"] = jax.make_array_from_process_local_data(
            NamedSharding(mesh, PartitionSpec("p")), local, (2, 3))
    return st


def _view(st: dict) -> dict:
    """The state's values as plain lists (this rank's view of them)."""
    out = {"kernel": np.asarray(st["model"].kernel.value).tolist(),
           "w": np.asarray(st["w"]).tolist(), "epoch": st["epoch"],
           "glob": np.asarray(st["glob"].addressable_data(0)).tolist()}
    if "sampler" in st:
        out["sampler"] = st["sampler"].state_dict()
    if "shard" in st:
        out["shard"] = np.asarray(st["shard"].addressable_data(0)).tolist()
    return out


def _case(root: str, who, kind: str, async_save: bool, rank: int) -> dict:
    import jdist
    from jdist.checkpoint import CheckpointError, CheckpointManager

    d = os.path.join(root, f"{who}-{kind}-{async_save}")
    m = CheckpointManager(d, async_save=async_save, peer_timeout=PEER_TIMEOUT, timeout=60)
    saved = _state(kind, rank, 7.0)
    rec = {"saved": _view(saved), "called": who == "all" or who == rank}
    if rec["called"]:
        t0 = time.monotonic()
        try:
            rec["save"] = m.save(5, saved)
            m.wait()
        except CheckpointError as e:
            rec["error"] = str(e)
        rec["save_s"] = time.monotonic() - t0
    jdist.barrier()
    rec["entries"] = sorted(os.listdir(d)) + sorted(
        os.listdir(os.path.join(d, "step_00000005")) if os.path.isdir(
            os.path.join(d, "step_00000005")) else [])
    rec["steps"] = m.all_steps()
    back = m.restore_or_init(lambda: _state(kind, rank, 0.0))
    rec["restored_step"], rec["restored"] = m.restored_step, _view(back)
    # then a save on every rank and a restore: nothing waits on the one-rank save
    t0 = time.monotonic()
    later = _state(kind, rank, 3.0)
    rec["after_expect"] = _view(later)
    m.save(6, later)
    m.wait()
    jdist.barrier()
    again = m.restore(_state(kind, rank, 0.0))
    rec["after"] = {"step": m.restored_step, "view": _view(again),
                    "s": time.monotonic() - t0}
    m.close()
    return rec


def grid(root: str) -> list:
    """Every case, in order, on this rank."""
    import jdist

    jdist.init_process_group(timeout=60)
    rank = jdist.get_rank()
    out = []
    for kind in STATES:
        for who in WHO:
            for async_save in (False, True):
                out.append({"who": who, "kind": kind, "async": async_save,
                            **_case(root, who, kind, async_save, rank)})
    jdist.destroy_process_group()
    return out
