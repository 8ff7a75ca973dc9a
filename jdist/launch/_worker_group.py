"""The worker processes of one node for one attempt: start, watch, stop, relay output.

Each worker runs in its own session (process group), so stopping it reaches every
process it started (``_stop``). Its stdout and stderr are pipes; a relay thread per
pipe (``_relay``) forwards what it writes, live and prefixed with ``[rank N]``, to the
launcher's console and/or a per-rank log file, keeping the last lines of stderr for
the failure summary.
"""

from __future__ import annotations

import os
import signal
import string
import subprocess
import threading
import time
from collections import deque
from typing import IO, NamedTuple

from jdist.launch import _keeper
from jdist.launch._blame import ERROR_FILE_VAR
from jdist.launch._relay import Console, Relay, start_relay
from jdist.launch._stop import stop_processes

__all__ = ["Worker", "WorkerGroup", "start_process", "Failure", "exit_code_of", "describe_exit",
           "line_prefix", "PREFIX_TEMPLATE_VAR"]

_TAIL_LINES = 20


class Failure(NamedTuple):
    """The first failed rank of an attempt."""

    rank: int
    local_rank: int
    node_rank: int
    exit_code: int  # the shell-style code: 128 + signal for a signal death
    how: str  # "exited with code 3" / "was killed by signal SIGKILL" / "raised E: msg"
    stderr_tail: str
    attempt: int
    time: float = 0.0  # wall-clock time of the failure (``_blame``); 0: unknown
    traceback: str = ""  # its Python traceback (or stack at a fatal signal), if known
    later: str = ""  # what failed after it on its node (consequences), for the summary


def exit_code_of(returncode: int) -> int:
    """A shell-style exit status (``128 + signal`` for a death by signal)."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"was killed by signal {name}"
    return f"exited with code {returncode}"


class Worker:
    """One child process and its output relays."""

    def __init__(self, rank: int, local_rank: int, proc: subprocess.Popen,
                 threads: list[threading.Thread], tail: deque, error_file: str | None = None):
        self.rank, self.local_rank, self.proc = rank, local_rank, proc
        self.threads, self.tail = threads, tail
        self.error_file = error_file  # its JDIST_ERROR_FILE (``_blame``), if any
        self.seen_alive = time.time()  # the last time a poll found it running

    def stderr_tail(self, wait: float = 1.0) -> str:
        """The last stderr lines (after the relay threads drained the pipe)."""
        for t in self.threads:
            t.join(wait)
        return b"".join(self.tail).decode("utf-8", "replace")


PREFIX_TEMPLATE_VAR = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"


def line_prefix(env: dict[str, str], rank: int, local_rank: int) -> bytes:
    """What starts each console line of a worker: ``[rank N] ``, or torchrun's
    ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` (``${rank}``, ``${local_rank}``,
    ``${role_name}``) where the worker's environment sets it."""
    template = env.get(PREFIX_TEMPLATE_VAR)
    if template is None:
        return f"[rank {rank}] ".encode()
    return string.Template(template).safe_substitute(
        rank=rank, local_rank=local_rank, role_name=env.get("ROLE_NAME", "default")).encode()


def start_process(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """``argv`` in a fresh process of its own session, stdout and stderr piped."""
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)


class WorkerGroup:
    """The workers of this node for one attempt.

    Args:
      commands: one ``(rank, local_rank, argv, env)`` per worker.
      stdout, stderr: the launcher's binary streams (None: not shown).
      log_dir: where ``rank_N/{stdout,stderr}.log`` go for this attempt, or None.
      hidden: ``hidden(local_rank)`` -> streams kept off the console (bit 1 stdout,
        bit 2 stderr), e.g. ``--redirects``.
      verbose: show the runtime's routine messages (see ``_relay.NOISE``).
      start: ``start(argv, env)`` -> a started process (``Popen``-like, in its own
        session, stdout and stderr pipes); default :func:`start_process`.
    """

    def __init__(self, commands, stdout: IO[bytes] | None, stderr: IO[bytes] | None,
                 log_dir: str | None, hidden=lambda local_rank: 0, verbose: bool = False,
                 start=None):
        self.workers: list[Worker] = []
        console = Console(stdout, stderr)
        start = start or start_process
        try:
            for rank, local_rank, argv, env in commands:
                proc = start(argv, env)
                _keeper.watch(proc.pid)
                files: dict[int, list[IO[bytes]]] = {1: [], 2: []}
                if log_dir is not None:
                    d = os.path.join(log_dir, f"rank_{rank}")
                    os.makedirs(d, exist_ok=True)
                    files[1].append(open(os.path.join(d, "stdout.log"), "wb"))
                    files[2].append(open(os.path.join(d, "stderr.log"), "wb"))
                tail: deque = deque(maxlen=_TAIL_LINES)
                prefix = line_prefix(env, rank, local_rank)
                off = hidden(local_rank)
                relays = [
                    (proc.stdout, Relay(prefix, None if off & 1 else console, 1, files[1],
                                        None, verbose)),
                    (proc.stderr, Relay(prefix, None if off & 2 else console, 2, files[2],
                                        tail, verbose)),
                ]
                threads = [start_relay(pipe, relay) for pipe, relay in relays]
                self.workers.append(Worker(rank, local_rank, proc, threads, tail,
                                           env.get(ERROR_FILE_VAR)))
        except BaseException:
            self.stop(0.0)
            raise

    def poll(self) -> tuple[list[Worker], list[Worker]]:
        """``(failed, running)`` workers right now (failed in rank order)."""
        failed, running = [], []
        now = time.time()
        for w in self.workers:
            code = w.proc.poll()
            if code is None:
                w.seen_alive = now
                running.append(w)
            elif code != 0:
                failed.append(w)
        return failed, running

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def stop(self, grace: float, sig: int = signal.SIGTERM) -> None:
        """``sig`` to every worker's process group, SIGKILL what is left after ``grace``."""
        stop_processes([w.proc for w in self.workers], grace, sig)
        for w in self.workers:
            for t in w.threads:
                t.join(1.0)
