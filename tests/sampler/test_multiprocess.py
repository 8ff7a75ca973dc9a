"""DistributedSampler in 2 real processes: defaults from the process group, exact eval."""

from __future__ import annotations

import numpy as np
from torch.utils.data import DistributedSampler as TorchSampler

from tests.helpers import run_procs


def _child() -> dict:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jdist
    from jdist.sampler import DistributedSampler, batches

    jdist.init_process_group(timeout=60)
    try:
        train = DistributedSampler(10, seed=3)  # num_replicas and rank from the group
        train.set_epoch(1)
        evaluation = DistributedSampler(11, shuffle=False, even_split=False)
        data = np.arange(11, dtype=np.float32) ** 2
        local = sum(float(b.sum()) for b in batches(evaluation, data, 4, prefetch=False))
        totals = jdist.all_reduce(np.array([local, len(evaluation)], np.float32))
        # prefetch onto a sharding over both processes: a global batch from local rows
        group = jdist.get_default_group()
        sharding = NamedSharding(group.mesh, P(group.axis_name))
        train.set_epoch(2)
        global_batches = [
            (b.shape, np.asarray(b.addressable_shards[0].data).tolist())
            for b in batches(train, np.arange(10) * 10, 2, drop_last=True, sharding=sharding)
        ]
        train.set_epoch(1)
        return {"replicas": train.num_replicas, "rank": train.rank, "train": list(train),
                "eval": list(evaluation), "totals": np.asarray(totals).tolist(),
                "global": global_batches}
    finally:
        jdist.destroy_process_group()


def test_two_processes_share_the_data_like_torch():
    results = run_procs(_child, nprocs=2, timeout=120)
    for rank, res in enumerate(results):
        assert (res["replicas"], res["rank"]) == (2, rank)
        theirs = TorchSampler(range(10), 2, rank, seed=3)
        theirs.set_epoch(1)
        assert res["train"] == list(theirs)
        # exact evaluation: the metric over all ranks is the metric over the dataset
        assert res["totals"] == [float((np.arange(11) ** 2).sum()), 11.0]
        theirs.set_epoch(2)
        rows = [i * 10 for i in theirs]
        assert res["global"] == [((4,), rows[0:2]), ((4,), rows[2:4])]
    assert sorted(results[0]["eval"] + results[1]["eval"]) == list(range(11))
