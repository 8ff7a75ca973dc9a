"""pytorch/examples' distributed programs (examples/ports/), and two RPC programs of our
own: jdist's port vs torch's run of the same program, time per step, in the same run.

Each program runs under ``jdist-run`` and its torch twin under ``torchrun``, one after
the other (never at the same time), with the programs' own batch shapes (the HybridModel's
bags vary in size from step to step). Prints, per program, the median time per step of
each (the first fifth of the steps, at least one, not timed: compilation, connection
set-up) and the ratio jdist / torch. With ``--repeats 2`` each program runs jdist,
torch, torch, jdist and the better median of each counts (a busy machine slows one
launch or the other)::

    python benchmarks/ports.py [--quick] [--repeats 2] [--only ddp_example rpc_pipeline]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _programs(quick: bool) -> list[tuple[str, int, object, str]]:
    """``(name, processes, args or args(lib, out), what a step is)`` per program."""
    from examples.ports._run import fresh_port

    # the two DDP ports take a few ms a step: enough steps that a median means something
    def tutorial(lib, out):
        return (["2", "10", "--dataset-size", "2048"] if quick else
                ["3", "10", "--dataset-size", "8192"]) + \
            ["--snapshot-path", os.path.join(out, "snapshot")]

    def hybrid(lib, out):
        size = ["--epochs", "1", "--batches", "6"] if quick else ["--epochs", "2",
                                                                 "--batches", "10"]
        # --rpc-timeout: the master's call to each trainer runs the whole training, and
        # torch's default 60 s bound was too short for jdist (a compile per bag shape)
        return size + ["--pg-port", str(fresh_port()), "--rpc-port", str(fresh_port()),
                       "--rpc-timeout", "900"]

    def hybrid_padded(lib, out):  # jdist with --pad; torch as the original
        return hybrid(lib, out) + (["--pad"] if lib == "jdist" else [])

    n = 10 if quick else 30
    return [
        ("ddp_example", 2, ["--steps", str(10 * n)],
         "DDP step, ToyModel, batch 20 per process"),
        ("ddp_tutorial", 2, tutorial, "DDP step, Linear(20, 1), batch 32 per process"),
        # one trainer: with two, torch's own run fails at random ("one of the variables
        # needed for gradient computation has been modified by an inplace operation":
        # one trainer's optimizer step lands inside the other's backward pass)
        # 50 of the data's 56 full batches (its one pass): the last four fifths timed
        ("rpc_parameter_server", 2, ["--steps", str(5 * n // 3)],
         "trainer step: forward by RPC, dist backward, DistributedOptimizer"),
        ("rpc_batch_ps", 3, ["--num-batches", str(max(5, n // 3))],
         "trainer step: local grads, @async_execution batched update (2 trainers)"),
        ("ddp_rpc", 4, hybrid, "HybridModel step, variable-size bags (2 trainers)"),
        ("ddp_rpc", 4, hybrid_padded, "HybridModel step, the same bags padded to one "
         "shape in the jdist run (--pad; torch unpadded)"),
        ("rpc_pipeline", 3, ["--num-batches", "3" if quick else "16"],
         "pipeline step: batch 32 in 4 micro-batches over 2 shards"),
        # our own programs (not pytorch/examples'): an RNN over a parameter server and
        # an RPC policy server
        ("rpc_rnn", 2, ["--steps", str(6 * n)],
         "trainer step: remote Embed and decoder, local LSTM, dist backward, "
         "DistributedOptimizer"),
        ("rpc_policy", 3, ["--episodes", str(max(2, n // 3)), "--steps", "100"],
         "observer's select_action round trip (4-128-2 policy, 2 observers)"),
    ]


def step_times(results: dict) -> np.ndarray:
    """Every ``times`` list in the ranks' results (several trainers: all of them), each
    without its first fifth (at least one step)."""
    found = []

    def walk(x):
        if isinstance(x, dict):
            if "times" in x:
                t = list(x["times"])
                found.append(t[max(1, len(t) // 5):])
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk({k: v for k, v in results.items() if isinstance(k, int)})
    return np.concatenate([np.asarray(t, float) for t in found if t] or [np.zeros(0)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps")
    p.add_argument("--only", nargs="*", help="program names")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per program")
    p.add_argument("--repeats", type=int, default=1, help="runs of each side (ABBA order)")
    a = p.parse_args()
    from benchmarks._parse import bench_json, row, table
    from examples.ports._run import PortRunError, run_both

    rows = []
    print("pytorch/examples programs, jdist port (jdist-run) vs torch (torchrun), CPU, "
          "median ms per step")
    for name, nproc, args, what in _programs(a.quick):
        if a.only and name not in a.only:
            continue
        medians: dict = {"jdist": [], "torch": []}
        counts = {}
        try:
            for rep in range(max(1, a.repeats)):
                tmp = tempfile.mkdtemp(prefix=f"bench_{name}_")
                order = ("jdist", "torch") if rep % 2 == 0 else ("torch", "jdist")
                mine, theirs = run_both(name, nproc, args, timeout=a.timeout,
                                        concurrent=False, tmp=tmp, order=order)
                for lib, res in (("jdist", mine), ("torch", theirs)):
                    t = step_times(res)
                    if t.size:
                        medians[lib].append(float(np.median(t)))
                        counts[lib] = t.size
        except PortRunError as e:
            print(f"  {name}: FAILED\n{str(e)[-3000:]}", flush=True)
            continue
        if not (medians["jdist"] and medians["torch"]):
            print(f"  {name}: no timed steps")
            continue
        tj, tt = counts["jdist"], counts["torch"]
        mj, mt = 1e3 * min(medians["jdist"]), 1e3 * min(medians["torch"])
        each = "  ".join(f"{lib} " + "/".join(f"{1e3 * m:.2f}" for m in ms)
                         for lib, ms in medians.items())
        print(f"  {name:22s} jdist {mj:9.2f} ms  torch {mt:9.2f} ms  ratio {mj / mt:6.2f}"
              f"  ({tj} / {tt} steps timed, best of {len(medians['jdist'])}; each run: "
              f"{each})", flush=True)
        rows.append(row(f"{name}: {what}", "ms", mj, mt, mj / mt,
                        f"{tj} jdist / {tt} torch steps timed, best of "
                        f"{len(medians['jdist'])} runs"))
    print(bench_json("ports", [table(
        "pytorch/examples programs ported to jdist, time per step (each program's own "
        "batch shapes)", "torch", "jdist / torch (time: lower is better)", rows)]))


if __name__ == "__main__":
    main()
