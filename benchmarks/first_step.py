"""Time to first step and whole-run wall time: the HybridModel port under jdist-run with
no compilation cache, a cold one and a warm one, against its torch twin, same run.

The program is ``examples/ports/ddp_rpc.py`` (pytorch/examples' HybridModel: a remote
EmbeddingBag on a parameter server, a DDP Linear on two trainers, a master; 4
processes), 2 epochs of 10 batches by default, and ``ddp_rpc_torch.py`` under torchrun.
The launches run one after the other:

- torch (torchrun);
- jdist with ``JDIST_COMPILATION_CACHE=0`` (no cache: jdist-run's behaviour before the
  cache was on by default);
- jdist with jdist-run's default cache in an empty directory (cold: every program
  compiles and is written);
- jdist again with that directory (warm: what a re-run of the same script gets).

Whole run: from starting the launcher to its exit. Time to first step, per trainer:
from starting the launcher to the end of that trainer's first training step (its
return time less the durations of its later steps). Training loop: the sum of a
trainer's step times, the first (which compiles, or loads from the cache) included.
For each jdist launch, each rank counts its programs (JAX's backend-compile events: a
compile or a load from the cache), its persistent cache hits, and the seconds in
tracing, lowering and compiling::

    python benchmarks/first_step.py [--epochs 2] [--batches 10] [--pad] [--repeats 1]

Each rank of a launch runs this file with ``--worker`` (the port's ``main`` with its
trainer function timed).
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

_PORTS = os.path.join(ROOT, "examples", "ports")  # the ports import their helpers by name
_PORT = {"jdist": "ddp_rpc", "torch": "ddp_rpc_torch"}
_ORIGINAL: dict = {}
_CACHE_VARS = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
               "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "JDIST_COMPILATION_CACHE")


# ---------------------------------------------------------------- one rank (--worker)
def timed_trainer(remote_emb_module, rank, args):
    """The port's trainer function, with the wall-clock time its first step ended."""
    res = _ORIGINAL["trainer"](remote_emb_module, rank, args)
    end = time.time()
    return dict(res, first_step_end=end - sum(res["times"][1:]))


def _watch_compiles(path: str) -> None:
    """Count this process's programs, cache hits and compile seconds; write them to
    ``path`` at exit."""
    import jax
    from jax._src import dispatch

    stats: dict = {"programs": Counter(), "seconds": defaultdict(float), "hits": Counter(),
                   "trace_s": 0.0, "lower_s": 0.0}

    def on_duration(event, secs, **kw):
        name = kw.get("fun_name", "?")
        if event == dispatch.BACKEND_COMPILE_EVENT:
            stats["programs"][name] += 1
            stats["seconds"][name] += secs
        elif event == dispatch.JAXPR_TRACE_EVENT:
            stats["trace_s"] += secs
        elif event == dispatch.JAXPR_TO_MLIR_MODULE_EVENT:
            stats["lower_s"] += secs

    class Hits(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if msg.startswith("Persistent compilation cache hit for '"):
                stats["hits"][msg.split("'")[1]] += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    log = logging.getLogger("jax._src.compiler")
    log.setLevel(logging.DEBUG)
    log.addHandler(Hits(logging.DEBUG))

    def dump():
        with open(path, "w") as f:
            json.dump(stats, f)

    atexit.register(dump)


def worker(lib: str, out: str, port_args: list) -> None:
    """One rank: the port's ``main`` with its trainer function timed."""
    if lib == "jdist":
        os.makedirs(out, exist_ok=True)
        _watch_compiles(os.path.join(out, f"compiles{os.environ['RANK']}.json"))
    import benchmarks.first_step as me  # the trainers look the wrapper up by this name

    sys.path.insert(0, _PORTS)
    port = importlib.import_module(_PORT[lib])
    me._ORIGINAL["trainer"] = port._run_trainer
    port._run_trainer = me.timed_trainer
    sys.argv = [port.__file__, *port_args, "--out", out]
    port.main()


# ---------------------------------------------------------------- the launches
def _launch(lib: str, port_args: list, out: str, env: dict, timeout: float) -> dict:
    from examples.ports._run import Launch, fresh_port

    me = os.path.abspath(__file__)
    if lib == "jdist":
        head = ["-m", "jdist.launch", "--nproc-per-node", "4", "--devices-per-proc", "1",
                "--master-port", str(fresh_port())]
    else:
        head = ["-m", "torch.distributed.run", "--nproc-per-node", "4",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{fresh_port()}"]
    cmd = [sys.executable, *head, me, "--worker", lib, "--out", out, "--", *port_args]
    start = time.time()
    res = Launch(cmd, out, env, nproc=4, torch_exit_abort_ok=lib == "torch").wait(
        time.monotonic() + timeout)
    wall = time.time() - start
    trainers = [t for r in res.values() if isinstance(r, dict)
                for t in r.get("trainers", [])]
    first = [t["first_step_end"] - start for t in trainers]
    steps = sorted(s for t in trainers for s in t["times"][max(1, len(t["times"]) // 5):])
    compiles = {}
    for rank in range(4):
        path = os.path.join(out, f"compiles{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                compiles[rank] = json.load(f)
    return {"wall": wall, "first": first, "step": steps[len(steps) // 2] if steps else 0.0,
            "loop": max((sum(t["times"]) for t in trainers), default=float("nan")),
            "step0": max((t["times"][0] for t in trainers), default=float("nan")),
            "compiles": compiles}


def _port_args(a, lib: str) -> list:
    from examples.ports._run import fresh_port

    args = ["--epochs", str(a.epochs), "--batches", str(a.batches),
            "--pg-port", str(fresh_port()), "--rpc-port", str(fresh_port()),
            "--rpc-timeout", "900"]
    return args + (["--pad"] if a.pad and lib == "jdist" else [])


def _describe(name: str, run: dict) -> None:
    print(f"  {name}: compiles per rank (programs, cache hits, seconds: compile or load "
          f"/ trace / lower)")
    for rank, c in sorted(run["compiles"].items()):
        n, hits = sum(c["programs"].values()), sum(c["hits"].values())
        top = sorted(c["seconds"].items(), key=lambda kv: -kv[1])[:4]
        slow = ", ".join(f"{k} x{c['programs'][k]} {v:.2f}s" for k, v in top)
        print(f"    rank {rank}: {n:3d} programs, {hits:3d} hits, "
              f"{sum(c['seconds'].values()):6.2f} / {c['trace_s']:5.2f} / "
              f"{c['lower_s']:5.2f} s; slowest: {slow}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        lib, out = sys.argv[2], sys.argv[4]
        worker(lib, out, sys.argv[sys.argv.index("--") + 1:])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batches", type=int, default=10, help="batches per epoch")
    p.add_argument("--pad", action="store_true", help="the jdist port's --pad (one shape)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of the four launches")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    a = p.parse_args()
    base = {k: v for k, v in os.environ.items() if k not in _CACHE_VARS}
    cases = ("torch", "jdist, no cache", "jdist, cold cache", "jdist, warm cache")
    runs: dict = {c: [] for c in cases}
    for _ in range(max(1, a.repeats)):
        tmp = tempfile.mkdtemp(prefix="bench_first_step_")
        xdg = os.path.join(tmp, "xdg")  # jdist-run's default cache lives under it
        envs = {"torch": base, "jdist, no cache": dict(base, JDIST_COMPILATION_CACHE="0"),
                "jdist, cold cache": dict(base, XDG_CACHE_HOME=xdg),
                "jdist, warm cache": dict(base, XDG_CACHE_HOME=xdg)}
        try:
            for case in cases:
                lib = case.split(",")[0]
                out = os.path.join(tmp, case.replace(", ", "_").replace(" ", "_"))
                runs[case].append(_launch(lib, _port_args(a, lib), out, envs[case],
                                          a.timeout))
                r = runs[case][-1]
                print(f"  {case:18s} whole run {r['wall']:6.2f} s, first step "
                      + " / ".join(f"{f:.2f}" for f in r["first"])
                      + f" s (trainers), training loop {r['loop']:.2f} s (first step "
                      f"{r['step0']:.2f} s), median step {1e3 * r['step']:.2f} ms", flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _report(a, runs, cases)


def _report(a, runs: dict, cases: tuple) -> None:
    from benchmarks._parse import bench_json, row, table

    best = {c: min(runs[c], key=lambda r: r["wall"]) for c in cases}
    torch_run = best["torch"]
    print(f"HybridModel port (examples/ports/ddp_rpc.py{', jdist --pad' if a.pad else ''}), "
          f"{a.epochs} epochs x {a.batches} batches, 4 processes, CPU; best of "
          f"{len(runs['torch'])} (whole run)")
    rows = []
    for case in cases[1:]:
        r = best[case]
        wall_ratio = r["wall"] / torch_run["wall"]
        first = max(r["first"]) if r["first"] else float("nan")
        tfirst = max(torch_run["first"]) if torch_run["first"] else float("nan")
        print(f"  {case:18s} whole run {r['wall']:6.2f} s vs torch {torch_run['wall']:6.2f} s"
              f" = {wall_ratio:5.2f}x;  first step (slower trainer) {first:6.2f} s vs "
              f"{tfirst:6.2f} s = {first / tfirst:5.2f}x")
        rows.append(row(f"whole run, {case}", "s", r["wall"], torch_run["wall"], wall_ratio,
                        "goal <= 1.5" if "warm" in case else ""))
        rows.append(row(f"time to first step (slower trainer), {case}", "s", first, tfirst,
                        first / tfirst))
        loop, tloop = r["loop"], torch_run["loop"]
        print(f"  {'':18s} training loop (slower trainer: its steps, the first included) "
              f"{loop:6.2f} s vs {tloop:6.2f} s = {loop / tloop:5.2f}x; its first step "
              f"{r['step0']:.2f} s vs {torch_run['step0']:.2f} s")
        rows.append(row(f"training loop, all steps (slower trainer), {case}", "s", loop,
                        tloop, loop / tloop))
    for case in cases[1:]:
        _describe(case, best[case])
    print(bench_json("first_step", [table(
        "HybridModel port: launch to first step and to exit (jdist-run's compilation "
        "cache none / cold / warm)", "torch", "jdist / torch (time: lower is better)",
        rows)]))


if __name__ == "__main__":
    main()
