"""DistributedSampler: jdist vs torch, time to produce all indices of one rank.

Run: ``PYTHONPATH=. python benchmarks/sampler.py [--repeats 3] [--sizes 1000000 10000000]``

For each dataset size it times, in the same run and on the same seeds:

* ``list(sampler)`` for torch's and jdist's sampler (what a data loader consumes),
  with 1 and 8 replicas (rank 0);
* jdist's ``sampler.indices()`` (the same indices as an int64 numpy array);
* the permutation alone: ``torch.randperm`` vs ``jdist.sampler.randperm``.

and prints jdist/torch ratios (lower is better; the goal is <= 3x). It also checks
that both produce identical indices. Timings are the best of ``--repeats`` runs, with
torch and jdist runs interleaved, so that load from other processes hits both alike.

``--quick`` uses sizes 10^5 and 10^6 and 2 repeats. The last line, ``BENCH_JSON {...}``,
holds the same numbers for benchmarks/run_all.py.

``--large`` also compares ``randperm`` with torch at n = 214748363 and 214748364, the two
sides of torch's switch to its inside-out algorithm (needs about 4 GB and a minute).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.utils.data import DistributedSampler as TorchSampler

from jdist.sampler import DistributedSampler, randperm


def _best_times(fn_a, fn_b, repeats):
    """Best-of-``repeats`` seconds for two functions run alternately, and their results."""
    best_a = best_b = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result_a = fn_a()
        best_a = min(best_a, time.perf_counter() - start)
        start = time.perf_counter()
        result_b = fn_b()
        best_b = min(best_b, time.perf_counter() - start)
    return best_a, best_b, result_a, result_b


def _torch_randperm(n, seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return torch.randperm(n, generator=g)


def run(sizes, repeats):
    rows = []
    seed, epoch = 1234, 3
    for n in sizes:
        t_torch, t_ours, perm_t, perm_j = _best_times(
            lambda n=n: _torch_randperm(n, seed + epoch), lambda n=n: randperm(n, seed + epoch),
            repeats)
        assert np.array_equal(perm_t.numpy(), perm_j), "randperm differs from torch"
        rows.append((n, "randperm (whole permutation)", t_torch, t_ours))
        for replicas in (1, 8):
            theirs = TorchSampler(range(n), replicas, 0, True, seed)
            ours = DistributedSampler(n, replicas, 0, True, seed)
            theirs.set_epoch(epoch)
            ours.set_epoch(epoch)
            t_torch, t_ours, list_t, list_j = _best_times(
                lambda s=theirs: list(s),
                lambda s=ours, e=epoch: (s.set_epoch(e + 1), s.set_epoch(e), list(s))[2],
                repeats)
            assert list_t == list_j, "sampler indices differ from torch"
            rows.append((n, f"list(sampler), {replicas} replicas", t_torch, t_ours))
            t_torch, t_np, list_t, arr = _best_times(
                lambda s=theirs: list(s), lambda s=ours: s.indices(), repeats)
            assert arr.tolist() == list_t
            rows.append((n, f"sampler.indices() (numpy), {replicas} replicas", t_torch, t_np))
    return rows


def check_large():
    from jdist.sampler import TORCH_SWAP_LIMIT

    for n, seed in [(TORCH_SWAP_LIMIT - 1, 2**32 + 3), (TORCH_SWAP_LIMIT, 5)]:
        t_torch, t_ours, perm_t, perm_j = _best_times(
            lambda n=n, s=seed: _torch_randperm(n, s).numpy(),
            lambda n=n, s=seed: randperm(n, s, dtype=np.int32), 1)
        same = bool(np.array_equal(perm_t, perm_j))
        del perm_t, perm_j
        print(f"randperm n={n} seed={seed}: identical={same}  torch {t_torch:.1f}s  "
              f"jdist {t_ours:.1f}s  ratio {t_ours / t_torch:.2f}x")
        assert same, f"randperm differs from torch at n={n}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10**6, 10**7])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="sizes 100000 and 1000000, 2 repeats")
    parser.add_argument("--large", action="store_true",
                        help="also check randperm at torch's algorithm switch (~4 GB)")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.repeats = [10**5, 10**6], 2
    if args.large:
        check_large()
    rows = run(args.sizes, args.repeats)
    print(f"{'n':>10}  {'what':<42} {'torch s':>9} {'jdist s':>9} {'jdist/torch':>11}")
    for n, what, t_torch, t_ours in rows:
        print(f"{n:>10}  {what:<42} {t_torch:>9.3f} {t_ours:>9.3f} {t_ours / t_torch:>10.2f}x")
    from benchmarks._parse import bench_json, row, table

    print(bench_json("sampler", [table(
        f"all indices of rank 0, best of {args.repeats}", "torch",
        "jdist / torch (lower is better; goal <= 3)",
        [row(f"n={n:,}: {what}", "s", t_ours, t_torch, t_ours / t_torch)
         for n, what, t_torch, t_ours in rows])]))


if __name__ == "__main__":
    main()
