"""Runs every jdist benchmark and writes docs/benchmarks.md with tables and PNG plots.

Each benchmark runs as its own subprocess (``PYTHONPATH`` = the repository root) under a
timeout, one after the other, with a progress bar. The report holds, per benchmark, a
table of jdist, its baseline and their ratio (the numbers the benchmark printed), the
plots (all_reduce time vs size, DDP step time per model, RPC latency and throughput),
the raw output, and a description of the machine.

    python benchmarks/run_all.py                      # full sizes (tens of minutes)
    python benchmarks/run_all.py --quick              # a few minutes on 2 idle cores
    python benchmarks/run_all.py --quick --only store rpc --out /tmp/bench.md

A benchmark that is missing, fails, times out or does not fit in the time budget
(``--budget``; 570 s with ``--quick``) is reported as such; the others still run. The
exit status is 1 if any benchmark did not finish ok.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._parse import parse  # noqa: E402
from benchmarks._report import Result, load_average, machine_info, make_plots, render  # noqa: E402


class Bench(NamedTuple):
    """One benchmark script and how to run it.

    Attributes:
        name: short name, for ``--only``.
        title: heading in the report.
        script: path relative to the repository root.
        quick: arguments for ``--quick`` when the script has neither a ``--quick`` nor a
            ``--smoke`` flag of its own (those are preferred, see :func:`quick_args`).
        full: arguments for a full run.
        quick_timeout: seconds allowed in quick mode.
        full_timeout: seconds allowed in a full run.
    """

    name: str
    title: str
    script: str
    quick: tuple = ()
    full: tuple = ()
    quick_timeout: float = 240.0
    full_timeout: float = 3600.0


BENCHES = (  # cheapest first, so that a time budget cuts the costly ones
    Bench("store", "TCPStore set+get (vs torch TCPStore)", "benchmarks/store.py"),
    Bench("ring_allreduce", "Ring all-reduce in shard_map (vs lax.psum)",
          "benchmarks/ring_allreduce.py"),
    Bench("sampler", "DistributedSampler (vs torch)", "benchmarks/sampler.py",
          quick=("--sizes", "100000", "1000000", "--repeats", "2")),
    Bench("collectives", "Eager all_reduce, 2 processes (vs torch gloo)",
          "benchmarks/collectives.py"),
    Bench("rpc", "RPC (vs torch.distributed.rpc and a raw socket)", "benchmarks/rpc.py",
          quick=("--rounds", "1", "--calls", "200", "--echoes", "3", "--mib", "16")),
    Bench("hooks_optim", "Comm hooks and ZeRO (vs no hook / plain data parallel)",
          "benchmarks/hooks_optim.py"),
    Bench("dp", "DataParallel (vs one device)", "benchmarks/dp.py", quick=("--reps", "5")),
    Bench("horovod", "Horovod-style AllReduceOptimizer, 2 processes (vs torch DDP)",
          "benchmarks/horovod.py"),
    Bench("hybrid", "HybridModel: DDP + RPC (vs torch)", "benchmarks/hybrid.py",
          quick=("--steps", "10", "--num-embeddings", "10000")),
    Bench("memory", "Peak host memory: torch's ZeRO recipe, 2 processes (vs torch)",
          "benchmarks/memory.py"),
    Bench("pipelining", "Pipeline schedules: 4 stages in one process, and 2 processes (vs torch)",
          "benchmarks/pipelining.py"),
    Bench("ports", "pytorch/examples programs ported (vs torch)", "benchmarks/ports.py",
          quick_timeout=480.0),
    Bench("first_step", "Time to first step and a short HybridModel run: compilation "
          "cache none/cold/warm (vs torch)", "benchmarks/first_step.py",
          quick_timeout=480.0),
    Bench("ft", "jdist.ft: step overhead, and a kill to the next step (vs DDP / a restart)",
          "benchmarks/ft.py", quick_timeout=300.0),
    Bench("checkpoint", "Checkpoints: async saving, restart to the first step (vs none / "
          "a first launch)", "benchmarks/checkpoint.py", quick_timeout=420.0),
    Bench("ddp", "DistributedDataParallel (vs hand-written JAX and torch DDP)",
          "benchmarks/ddp.py", quick=("--steps", "5"), quick_timeout=360.0),
    Bench("data", "Feeding a DDP step: torch DataLoader, grain, ArrayLoader (vs torch "
          "DataLoader + torch DDP)", "benchmarks/data.py", quick_timeout=300.0),
)
NAMES = tuple(b.name for b in BENCHES)
QUICK_BUDGET = 570.0  # seconds: --quick writes its report within 10 minutes
MIN_SECONDS = 20.0  # a benchmark is not started with less of the budget left


def quick_args(bench: Bench, source: str) -> list[str]:
    """The script's own ``--quick`` (or else ``--smoke``) flag if it has one, else
    ``bench.quick``."""
    for flag in ("--quick", "--smoke"):
        if f'"{flag}"' in source or f"'{flag}'" in source:
            return [flag]
    return list(bench.quick)


def run_command(cmd: list[str], timeout: float, *, cwd: Path = ROOT, env: dict | None = None,
                tick=None) -> tuple[str, int | None, float]:
    """Runs ``cmd`` in its own session, stdout and stderr merged.

    Args:
        cmd: the command.
        timeout: seconds; on expiry the command and everything it started are
            terminated, then killed (:func:`_kill_group`).
        cwd: working directory.
        env: environment (default: this one).
        tick: called about once a second with the seconds elapsed (progress display).

    Returns:
        ``(output, exit status or None if it timed out, seconds)``.
    """
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(
        lambda: proc.stdout.read1(65536), b"")), daemon=True)
    reader.start()
    rc: int | None = None
    while True:
        left = timeout - (time.monotonic() - start)
        try:
            rc = proc.wait(timeout=min(1.0, max(left, 0.01)))
            break
        except subprocess.TimeoutExpired:
            if tick:
                tick(time.monotonic() - start)
            if left <= 0:
                _kill_group(proc)
                rc = None
                break
    reader.join(10)
    out = b"".join(chunks).decode("utf-8", "replace")
    return out, rc, time.monotonic() - start


def _stat(pid: int | str) -> tuple[int, int] | None:
    """``(parent pid, start time)`` of a process from /proc, None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19])  # the name before ')' may hold spaces


def descendants(pid: int) -> list[tuple[int, int]]:
    """``(pid, start time)`` of every descendant of ``pid`` (empty without /proc)."""
    children: dict[int, list[tuple[int, int]]] = {}
    proc = Path("/proc")
    for entry in proc.iterdir() if proc.is_dir() else ():
        st = _stat(entry.name) if entry.name.isdigit() else None
        if st is not None:
            children.setdefault(st[0], []).append((int(entry.name), st[1]))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c[0])
    return out


def _signal(procs: list[tuple[int, int]], sig: int) -> None:
    """Signals each process, and the group it leads, if it is still the one listed."""
    for pid, start in procs:
        st = _stat(pid)
        if st is None or st[1] != start:  # gone, or the id now names another process
            continue
        for fn in (os.killpg, os.kill):
            try:
                fn(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _kill_group(proc: subprocess.Popen) -> None:
    """Stops the benchmark this run started and everything it started.

    The benchmark's process group and every descendant (``jdist.launch.spawn`` starts
    workers in sessions of their own, which a group signal misses) get SIGTERM, then
    SIGKILL after 5 s. Descendants are listed first: once their parent is gone they are
    re-parented and can no longer be told apart.
    """
    st = _stat(proc.pid)
    procs = ([(proc.pid, st[1])] if st else []) + descendants(proc.pid)
    _signal(procs, signal.SIGTERM)
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass
    time.sleep(0.5)
    _signal(procs, signal.SIGKILL)
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass


def run_bench(bench: Bench, quick: bool, tick=None, root: Path = ROOT,
              budget: float | None = None) -> Result:
    """Runs one benchmark and parses its output.

    Args:
        bench: what to run.
        quick: quick arguments and timeout instead of the full ones.
        tick: progress callback, see :func:`run_command`.
        root: the repository root (working directory and ``PYTHONPATH``).
        budget: seconds left of the whole run, if limited: the timeout is at most this,
            and under :data:`MIN_SECONDS` left the benchmark is ``skipped``.

    Returns:
        The result; a missing script is a ``missing`` result, nothing raises.
    """
    path = root / bench.script
    shown = f"python {bench.script}"
    if not path.is_file():
        return Result(bench.name, bench.title, shown, "missing",
                      f"{bench.script} does not exist", 0.0, "", parse(bench.name, ""))
    args = quick_args(bench, path.read_text()) if quick else list(bench.full)
    shown = " ".join(["python", bench.script, *map(shlex.quote, args)])
    timeout = bench.quick_timeout if quick else bench.full_timeout
    if budget is not None:
        if budget < MIN_SECONDS:
            return Result(bench.name, bench.title, shown, "skipped",
                          f"only {budget:.0f} s of the time budget left (--budget)", 0.0, "",
                          parse(bench.name, ""))
        timeout = min(timeout, budget)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    out, rc, secs = run_command([sys.executable, str(path), *args], timeout, cwd=root,
                                env=env, tick=tick)
    try:
        parsed = parse(bench.name, out)
    except ValueError as e:
        parsed = parse(bench.name, "")
        out += f"\n[run_all: could not parse the output: {e}]"
    if rc is None:
        status, detail = "timed out", f"stopped after {timeout:.0f} s"
    elif rc != 0:
        status, detail = "failed", f"exit status {rc}"
    else:
        status, detail = "ok", ""
    return Result(bench.name, bench.title, shown, status, detail, secs, out, parsed)


def write_report(results: list[Result], machine: dict, out: Path, *, mode: str, started: str,
                 total_s: float, command: str) -> Path:
    """Writes the plots under ``<out's folder>/img`` and the Markdown report to ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    images = make_plots(results, out.parent / "img", "img")
    gpu_link = Path(os.path.relpath(ROOT / "docs" / "gpu.md", out.parent.resolve())).as_posix()
    out.write_text(render(results, machine, images, mode=mode, started=started,
                          total_s=total_s, command=command, gpu_link=gpu_link))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="small sizes and few steps (a few minutes on 2 idle cores)")
    p.add_argument("--only", nargs="+", choices=NAMES, metavar="NAME",
                   help=f"run only these benchmarks ({', '.join(NAMES)})")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md",
                   help="the Markdown report (plots go to img/ next to it)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per benchmark (default: 240 quick, 360 for ddp; 3600 full)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for all benchmarks together; the ones left when it runs "
                        f"out are skipped (default: {QUICK_BUDGET:.0f} with --quick, none "
                        f"without)")
    a = p.parse_args(argv)
    budget = a.budget if a.budget is not None else QUICK_BUDGET if a.quick else None
    if budget is not None and budget <= 0:
        p.error(f"--budget must be positive seconds, got {a.budget}")
    benches = [b for b in BENCHES if not a.only or b.name in a.only]
    if a.timeout is not None:
        if a.timeout <= 0:
            p.error(f"--timeout must be positive seconds, got {a.timeout}")
        benches = [b._replace(quick_timeout=a.timeout, full_timeout=a.timeout)
                   for b in benches]
    from tqdm import tqdm

    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = machine_info(str(ROOT))
    t0 = time.monotonic()
    results = []
    bar = tqdm(benches, unit="bench", dynamic_ncols=True)
    for b in bar:
        bar.set_description(b.name)
        left = None if budget is None else budget - (time.monotonic() - t0)
        res = run_bench(b, a.quick, tick=lambda s: bar.set_postfix_str(f"{s:.0f} s"),
                        budget=left)
        bar.write(f"{b.name:15s} {res.status:9s} {res.seconds:6.0f} s  "
                  f"{len([r for t in res.parsed.tables for r in t['rows']])} rows "
                  f"({res.parsed.source})" + (f"  {res.detail}" if res.detail else ""))
        results.append(res)
    bar.close()
    machine["load_end"] = load_average()
    cmd = "python benchmarks/run_all.py" + (" --quick" if a.quick else "") + (
        " --only " + " ".join(a.only) if a.only else "")
    out = write_report(results, machine, a.out, mode="quick" if a.quick else "full",
                       started=started, total_s=time.monotonic() - t0, command=cmd)
    print(f"wrote {out} in {(time.monotonic() - t0) / 60:.1f} min")
    return 0 if all(r.status == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
