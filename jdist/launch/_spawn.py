"""``spawn(fn, nprocs=N)``: run a picklable function in N real processes.

Each process gets the environment ``jdist-run`` would give it (RANK, WORLD_SIZE,
MASTER_ADDR/PORT on a free loopback port, JDIST_AUTH_TOKEN, N virtual CPU devices),
runs ``fn(*args)`` and sends back its return value. Nothing hangs: a rank that fails
ends the others (SIGTERM, then SIGKILL after ``grace``), and the whole run has a hard
``timeout``. The error names each failed rank with its exit code and stderr tail.
"""

from __future__ import annotations

import os
import pickle
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from jdist.store import free_port

__all__ = ["spawn", "SpawnError", "free_port", "xla_flags_with_devices"]


class SpawnError(RuntimeError):
    """One or more spawned ranks failed or timed out; the message has their stderr."""

    def __init__(self, message: str, exitcodes: dict[int, int | None], stderr: dict[int, str]):
        super().__init__(message)
        self.exitcodes = exitcodes
        self.stderr = stderr


def xla_flags_with_devices(flags: str, devices: int) -> str:
    """``flags`` with ``--xla_force_host_platform_device_count`` set to ``devices``."""
    kept = [f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count")]
    kept.append(f"--xla_force_host_platform_device_count={int(devices)}")
    return " ".join(kept)


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _kill_all(procs: Sequence[subprocess.Popen], grace: float) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()


def spawn(
    fn: Callable[..., Any],
    args: tuple = (),
    nprocs: int = 2,
    devices_per_proc: int = 1,
    timeout: float = 120.0,
    *,
    env: dict[str, str] | None = None,
    grace: float = 3.0,
    rank_args: Sequence[tuple] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` in ``nprocs`` fresh processes; return each rank's result.

    Args:
      fn: a picklable (module-level) function. It runs in a new interpreter where
        ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` are set; it calls
        ``jdist.init_process_group()`` itself if it needs one.
      args: positional arguments, the same for every rank.
      nprocs: number of processes.
      devices_per_proc: virtual CPU devices per process.
      timeout: seconds for the whole run; past it every rank is killed.
      env: extra environment variables for every rank.
      grace: seconds between SIGTERM and SIGKILL when ranks are ended.
      rank_args: optional per-rank argument tuples, overriding ``args``.

    Returns:
      ``[result_of_rank_0, ..., result_of_rank_{n-1}]``.

    Raises:
      SpawnError: a rank exited non-zero or the run timed out; the message names the
        ranks and shows the tail of each one's stderr.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if rank_args is not None and len(rank_args) != nprocs:
        raise ValueError(f"rank_args has {len(rank_args)} entries for nprocs={nprocs}")
    tmp = tempfile.mkdtemp(prefix="jdist-spawn-")
    procs: list[subprocess.Popen] = []
    try:
        port = free_port()
        token = secrets.token_hex(16)
        base = dict(os.environ)
        base.update(env or {})
        base["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        base["XLA_FLAGS"] = xla_flags_with_devices(base.get("XLA_FLAGS", ""), devices_per_proc)
        base.setdefault("JDIST_AUTH_TOKEN", token)
        base["PYTHONUNBUFFERED"] = "1"
        for r in range(nprocs):
            payload = os.path.join(tmp, f"in{r}.pkl")
            with open(payload, "wb") as f:
                pickle.dump((fn, tuple(rank_args[r]) if rank_args else tuple(args)), f)
            e = dict(base)
            e.update(
                RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nprocs),
                LOCAL_WORLD_SIZE=str(nprocs), GROUP_RANK="0", GROUP_WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                JDIST_DEVICES_PER_PROC=str(devices_per_proc),
                JDIST_RESTART_COUNT="0", JDIST_MAX_RESTARTS="0",
            )
            out = open(os.path.join(tmp, f"out{r}.txt"), "wb")
            err = open(os.path.join(tmp, f"err{r}.txt"), "wb")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "jdist.launch._worker", payload,
                 os.path.join(tmp, f"res{r}.pkl")],
                env=e, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                start_new_session=True,
            ))
            out.close()
            err.close()
        deadline = time.monotonic() + timeout
        failed: list[int] = []
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if failed or any(p.poll() is None for p in procs):
            timed_out = not failed
            _kill_all(procs, grace)
            codes = {r: p.returncode for r, p in enumerate(procs)}
            tails = {r: _tail(os.path.join(tmp, f"err{r}.txt")) for r in range(nprocs)}
            what = (f"timed out after {timeout:.0f}s" if timed_out else
                    "failed: " + ", ".join(f"rank {r} exited with {codes[r]}" for r in failed))
            body = "\n".join(f"--- rank {r} (exit {codes[r]}) stderr tail ---\n{tails[r]}"
                             for r in range(nprocs))
            raise SpawnError(f"spawn of {nprocs} processes {what}\n{body}", codes, tails)
        results = []
        for r in range(nprocs):
            with open(os.path.join(tmp, f"res{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
    finally:
        _kill_all(procs, 0.5)
        shutil.rmtree(tmp, ignore_errors=True)
