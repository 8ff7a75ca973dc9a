"""``spawn(fn, nprocs=N)``: ``torch.multiprocessing.spawn`` for jdist, in real processes.

Each process gets the environment ``jdist-run`` gives its workers (``_env.worker_env``:
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT on a free loopback port, ROLE_*,
JDIST_RUN_ID, JDIST_AUTH_TOKEN, OMP_NUM_THREADS=1 by default, N virtual CPU devices)
and the parent's ``sys.argv``, runs ``fn(*args)`` (``fn(rank, *args)`` with
``pass_rank=True``, torch's convention) and sends back its return value. ``fn`` may be
defined in the ``__main__`` script, as in every ``mp.spawn`` example. The children's
stdout and stderr are forwarded live, each line prefixed with ``[rank N]``.

Nothing is left behind: a rank that fails ends the others at once (SIGTERM, then
SIGKILL after ``grace``) and the error names it; SIGTERM to the parent stops every
child before the parent exits; each child dies with its parent even if the parent is
SIGKILLed (``_spawn_child``). There is no default timeout (torch has none); an optional
``timeout`` bounds the whole run.
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
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from jdist.launch import _keeper
from jdist.launch._env import JobInfo, worker_env, xla_flags_with_devices
from jdist.launch._forkserver import forkserver_process
from jdist.launch._relay import Console, Relay, start_relay
from jdist.launch._stop import stop_processes
from jdist.store import free_port

__all__ = ["spawn", "SpawnError", "free_port", "xla_flags_with_devices"]

_TAIL_LINES = 25
_POLL_S = 0.02


class SpawnError(RuntimeError):
    """One or more spawned ranks failed or timed out; the message has their stderr."""

    def __init__(self, message: str, exitcodes: dict[int, int | None], stderr: dict[int, str]):
        super().__init__(message)
        self.exitcodes = exitcodes
        self.stderr = stderr


class _Terminated(BaseException):
    pass


class _TextStream:
    """Bytes in, written to a text stream as it is now (pytest's capture, Jupyter)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, data: bytes) -> None:
        self.stream.write(data.decode("utf-8", "replace"))

    def flush(self) -> None:
        self.stream.flush()


def _main_of(fn: Callable, blob: bytes) -> tuple[str, str] | None:
    """How a child loads the parent's ``__main__`` (None when the payload needs none)."""
    if b"__main__" not in blob:
        return None
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        return "module", spec.name
    path = getattr(main, "__file__", None)
    if path and os.path.isfile(path):
        return "path", os.path.abspath(path)
    raise ValueError(
        f"spawn: {fn!r} (or one of its arguments) is defined in the __main__ of an "
        f"interactive session, which a new process cannot import; define it in a .py "
        f"file and import it from there")


def _check(nprocs, rank_args, timeout, join, start_method) -> None:
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if rank_args is not None and len(rank_args) != nprocs:
        raise ValueError(f"rank_args has {len(rank_args)} entries for nprocs={nprocs}; give "
                         f"one argument tuple per rank")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"timeout must be None (no limit) or seconds > 0, got {timeout!r}")
    if not join:
        raise ValueError("spawn(join=False) is not supported: spawn waits for every rank "
                         "and returns their results; run it in a thread to do other work")
    if start_method not in ("spawn", "forkserver", "fork"):
        raise ValueError(f"start_method={start_method!r}: use 'spawn' (a fresh "
                         f"interpreter per rank) or 'forkserver' (ranks forked from a "
                         f"server that imported set_forkserver_preload's modules once)")


def spawn(
    fn: Callable[..., Any],
    args: tuple = (),
    nprocs: int = 2,
    devices_per_proc: int = 1,
    timeout: float | None = None,
    *,
    env: dict[str, str] | None = None,
    grace: float = 3.0,
    rank_args: Sequence[tuple] | None = None,
    pass_rank: bool = False,
    verbose: bool = False,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> list[Any]:
    """Run ``fn(*args)`` in ``nprocs`` fresh processes; return each rank's result.

    Args:
      fn: a picklable function: module-level, in a module or in the ``__main__``
        script. It runs in a new interpreter with the job's environment; it calls
        ``jdist.init_process_group()`` itself if it needs one.
      args: positional arguments, the same for every rank.
      nprocs: number of processes.
      devices_per_proc: virtual CPU devices per process.
      timeout: seconds for the whole run (None: no limit, as in torch); past it every
        rank is stopped and :class:`SpawnError` raised.
      env: extra environment variables for every rank.
      grace: seconds between SIGTERM and SIGKILL when ranks are ended.
      rank_args: optional per-rank argument tuples, overriding ``args``.
      pass_rank: call ``fn(rank, *args)`` as ``torch.multiprocessing.spawn`` does.
      verbose: also forward the runtime's routine messages (see ``jdist-run
        --verbose``).
      start_method: ``"spawn"`` (default): each rank is a fresh interpreter;
        ``"forkserver"``: ranks are forked from a server process that imported the
        modules of :func:`set_forkserver_preload` (JAX, Flax, Optax, numpy by default)
        once per caller and environment, so a rank starts in milliseconds instead of
        seconds of imports (``_forkserver``); ``"fork"`` is taken as ``"spawn"``
        (forking a caller that may have started JAX's runtime is unsafe).
      join, daemon: torch's; ``join`` must be True, ``daemon`` is accepted (ranks
        always end with the caller).

    Returns:
      ``[result_of_rank_0, ..., result_of_rank_{n-1}]``.

    Raises:
      SpawnError: a rank exited non-zero (raised as soon as it does) or the run timed
        out; the message names the ranks and shows the tail of each one's stderr.
    """
    del daemon
    _check(nprocs, rank_args, timeout, join, start_method)
    payloads = []
    for r in range(nprocs):
        call_args = tuple(rank_args[r]) if rank_args else tuple(args)
        try:
            payloads.append(pickle.dumps((fn, (r, *call_args) if pass_rank else call_args)))
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise ValueError(f"spawn: {fn!r} and its arguments must be picklable (a "
                             f"function defined at module level, not a lambda or a nested "
                             f"function): {e}") from e
    header = pickle.dumps({"argv": list(sys.argv),
                           "main": _main_of(fn, b"".join(payloads))})
    tmp = tempfile.mkdtemp(prefix="jdist-spawn-")
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    tails: list[deque] = []
    previous = _install_sigterm()
    try:
        base = dict(os.environ)
        base.update(env or {})
        base["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        job = JobInfo(world_size=nprocs, rank_offset=0, nnodes=1, node_rank=0,
                      local_world_size=nprocs, master_addr="127.0.0.1",
                      master_port=free_port(), token=base.get("JDIST_AUTH_TOKEN") or
                      secrets.token_hex(16), run_id=secrets.token_hex(8), restart_count=0,
                      max_restarts=0)
        console = Console(*(_TextStream(st) if st is not None else None
                            for st in (sys.stdout, sys.stderr)))
        for r in range(nprocs):
            payload = os.path.join(tmp, f"in{r}.pkl")
            with open(payload, "wb") as f:
                f.write(header)
                f.write(payloads[r])
            child_argv = [payload, os.path.join(tmp, f"res{r}.pkl")]
            rank_env = worker_env(base, job, r, devices_per_proc)
            if start_method == "forkserver":
                proc = forkserver_process(child_argv, base, rank_env)
            else:
                proc = subprocess.Popen(
                    [sys.executable, "-u", "-m", "jdist.launch._spawn_child", *child_argv,
                     str(os.getpid())], env=rank_env, stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            procs.append(proc)
            _keeper.watch(proc.pid)
            tail: deque = deque(maxlen=_TAIL_LINES)
            tails.append(tail)
            prefix = f"[rank {r}] ".encode()
            threads.append(start_relay(proc.stdout, Relay(prefix, console, 1, (), None,
                                                          verbose)))
            threads.append(start_relay(proc.stderr, Relay(prefix, console, 2, (), tail,
                                                          verbose)))
        failed, timed_out = _wait(procs, timeout)
        if failed or timed_out:
            stop_processes(procs, grace)
            for t in threads:
                t.join(2.0)
            codes = {r: p.returncode for r, p in enumerate(procs)}
            text = {r: b"".join(tails[r]).decode("utf-8", "replace") for r in range(nprocs)}
            what = (f"timed out after {timeout:g}s" if timed_out else
                    "failed: " + ", ".join(f"rank {r} exited with {codes[r]}" for r in failed))
            body = "\n".join(f"--- rank {r} (exit {codes[r]}) stderr tail ---\n{text[r]}"
                             for r in range(nprocs))
            raise SpawnError(f"spawn of {nprocs} processes {what}\n{body}", codes, text)
        for t in threads:
            t.join(2.0)
        results = []
        for r in range(nprocs):
            with open(os.path.join(tmp, f"res{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
    except _Terminated:
        stop_processes(procs, grace)
        shutil.rmtree(tmp, ignore_errors=True)
        _restore_sigterm(previous)
        _resend_sigterm(previous)  # the default handler ends the process here
        raise SpawnError(f"spawn of {nprocs} processes was stopped by SIGTERM; every rank "
                         f"was stopped", {r: p.returncode for r, p in enumerate(procs)},
                         {}) from None
    finally:
        stop_processes(procs, 0.5)
        _restore_sigterm(previous)
        shutil.rmtree(tmp, ignore_errors=True)


def _wait(procs: Sequence[subprocess.Popen], timeout: float | None) -> tuple[list[int], bool]:
    """``(failed ranks, timed out)`` once every rank exited 0, one failed, or time ran out."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed or all(c == 0 for c in codes):
            return failed, False
        if deadline is not None and time.monotonic() > deadline:
            return [], True
        time.sleep(_POLL_S)


def _install_sigterm():
    """While the children run, SIGTERM to the parent stops them first (main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN:
        return None

    def on_sigterm(signum, frame):
        raise _Terminated()

    signal.signal(signal.SIGTERM, on_sigterm)
    return (previous,)


def _restore_sigterm(previous) -> None:
    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, previous[0] if previous[0] is not None
                      else signal.SIG_DFL)


def _resend_sigterm(previous) -> None:
    """Hand SIGTERM to what the program had installed (the default ends the process)."""
    handler = previous[0] if previous is not None else signal.SIG_DFL
    if callable(handler):
        handler(signal.SIGTERM, None)
    elif handler in (signal.SIG_DFL, None):
        os.kill(os.getpid(), signal.SIGTERM)
