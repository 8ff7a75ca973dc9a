"""Peak host memory per rank: torch's ZeRO recipe in jdist vs torch, same run.

Run: ``PYTHONPATH=. python benchmarks/memory.py [--quick] [--steps 3]``.

The program is ``examples/ports/zero_recipe.py`` and its torch twin (torch's
``ZeroRedundancyOptimizer`` recipe: 20 x ``Linear(2000, 2000)``, 80M parameters,
DDP over 2 processes with Adam, or with Adam sharded by ZeRO), each under its own
launcher (``jdist-run``, ``torchrun``), one after the other so that neither measures
the other's pages. Each rank reports its peak resident set (``ru_maxrss``: import,
model, DDP's init sync, every step); the table shows the larger rank of each side and
the ratio (goal: <= 1.1). Also the median step time of each (after the first step).

The optimizer state per rank is 640 MB (Adam) and 320 MB (ZeRO) on both sides; what a
step adds on top is where buffer donation (``jdist/_donation.py``) matters: without it a
step held old and new parameters and optimizer state. ``--quick``: 6 layers of 1000
(for CI-sized checks; the ratio there is dominated by the two runtimes' own footprint).

Device memory on a GPU: ``benchmarks/gpu.py`` when a GPU is lent (none on this machine).
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np


def _run(name_args: list[str], timeout: float) -> dict:
    from examples.ports._run import run_one

    out = {}
    for lib in ("torch", "jdist"):
        tmp = tempfile.mkdtemp(prefix=f"bench_memory_{lib}_")
        res = run_one(lib, "zero_recipe", 2, name_args, timeout=timeout, tmp=tmp)
        ranks = [res[r] for r in sorted(k for k in res if isinstance(k, int))]
        out[lib] = dict(
            peak=max(r["peak_rss_mb"] for r in ranks),
            per_rank=[round(r["peak_rss_mb"]) for r in ranks],
            step_ms=1e3 * float(np.median(np.concatenate(
                [np.asarray(r["times"][1:] or r["times"]) for r in ranks]))))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="6 x Linear(1000, 1000)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    a = p.parse_args(argv)
    from benchmarks._parse import bench_json, row, table

    size = ["--width", "1000", "--layers", "6"] if a.quick else []
    rows = []
    print("torch's ZeRO recipe, 2 processes, peak RSS per rank (larger rank) and median "
          "step time", flush=True)
    for label, flag in (("DDP + Adam", []), ("DDP + ZeRO(Adam)", ["--zero"])):
        got = _run(["--steps", str(a.steps), *size, *flag], a.timeout)
        j, t = got["jdist"], got["torch"]
        ratio = j["peak"] / t["peak"]
        print(f"  {label:18s} jdist {j['peak']:7.0f} MB {j['per_rank']}  torch "
              f"{t['peak']:7.0f} MB {t['per_rank']}  ratio {ratio:5.2f}  | step jdist "
              f"{j['step_ms']:8.1f} ms  torch {t['step_ms']:8.1f} ms", flush=True)
        rows.append(row(f"{label}: peak RSS per rank", "MB", j["peak"], t["peak"], ratio,
                        f"ranks jdist {j['per_rank']}, torch {t['per_rank']}"))
        rows.append(row(f"{label}: median step", "ms", j["step_ms"], t["step_ms"]))
    print(bench_json("memory", [table(
        "torch's ZeRO recipe (20 x Linear(2000, 2000), 2 processes): peak host memory",
        "torch", "jdist / torch (lower is better)", rows)]))


if __name__ == "__main__":
    main()
