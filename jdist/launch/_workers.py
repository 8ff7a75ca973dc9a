"""The worker processes of one node for one attempt: start, watch, stop, relay output.

Each worker runs in its own session (process group), so stopping it reaches every
process it started: SIGTERM to the group, SIGKILL after the grace period. Its stdout
and stderr are pipes; one thread per pipe prefixes each line with ``[rank N]`` and
writes it to the launcher's stdout/stderr (and/or a log file), keeping the last lines
of stderr for the failure summary.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import IO, NamedTuple

__all__ = ["Worker", "WorkerGroup", "Failure", "exit_code_of", "describe_exit"]

_TAIL_LINES = 20


class Failure(NamedTuple):
    """The first failed rank of an attempt."""

    rank: int
    local_rank: int
    node_rank: int
    exit_code: int  # the shell-style code: 128 + signal for a signal death
    how: str  # "exited with code 3" / "was killed by signal SIGKILL"
    stderr_tail: str
    attempt: int


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


class _Sink:
    """Serialised line output to one stream."""

    def __init__(self, stream: IO[bytes] | None):
        self.stream = stream
        self.lock = threading.Lock()

    def write(self, data: bytes) -> None:
        if self.stream is None:
            return
        with self.lock:
            try:
                self.stream.write(data)
                self.stream.flush()
            except (OSError, ValueError):
                pass


class Worker:
    """One child process and its output relays."""

    def __init__(self, rank: int, local_rank: int, proc: subprocess.Popen,
                 threads: list[threading.Thread], tail: deque):
        self.rank, self.local_rank, self.proc = rank, local_rank, proc
        self.threads, self.tail = threads, tail

    def stderr_tail(self, wait: float = 1.0) -> str:
        """The last stderr lines (after the relay threads drained the pipe)."""
        for t in self.threads:
            t.join(wait)
        return b"".join(self.tail).decode("utf-8", "replace")


def _pump(pipe: IO[bytes], prefix: bytes, sinks: Sequence[_Sink],
          files: Sequence[IO[bytes]], tail: deque | None) -> None:
    try:
        for line in iter(pipe.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            if tail is not None:
                tail.append(line)
            for s in sinks:
                s.write(prefix + line)
            for f in files:
                f.write(line)
                f.flush()
    except (OSError, ValueError):
        pass
    finally:
        pipe.close()
        for f in files:
            f.close()


class WorkerGroup:
    """The workers of this node for one attempt.

    Args:
      commands: one ``(rank, local_rank, argv, env)`` per worker.
      stdout, stderr: the launcher's binary streams (None: not shown).
      log_dir: where ``rank_N/{stdout,stderr}.log`` go for this attempt, or None.
    """

    def __init__(self, commands, stdout: IO[bytes] | None, stderr: IO[bytes] | None,
                 log_dir: str | None):
        self.workers: list[Worker] = []
        out_sink, err_sink = _Sink(stdout), _Sink(stderr)
        try:
            for rank, local_rank, argv, env in commands:
                proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        start_new_session=True)
                out_files: list[IO[bytes]] = []
                err_files: list[IO[bytes]] = []
                if log_dir is not None:
                    d = os.path.join(log_dir, f"rank_{rank}")
                    os.makedirs(d, exist_ok=True)
                    out_files.append(open(os.path.join(d, "stdout.log"), "wb"))
                    err_files.append(open(os.path.join(d, "stderr.log"), "wb"))
                tail: deque = deque(maxlen=_TAIL_LINES)
                prefix = f"[rank {rank}] ".encode()
                threads = [
                    threading.Thread(target=_pump, daemon=True,
                                     args=(proc.stdout, prefix, [out_sink], out_files, None)),
                    threading.Thread(target=_pump, daemon=True,
                                     args=(proc.stderr, prefix, [err_sink], err_files, tail)),
                ]
                for t in threads:
                    t.start()
                self.workers.append(Worker(rank, local_rank, proc, threads, tail))
        except BaseException:
            self.stop(0.0)
            raise

    def poll(self) -> tuple[list[Worker], list[Worker]]:
        """``(failed, running)`` workers right now (failed in rank order)."""
        failed, running = [], []
        for w in self.workers:
            code = w.proc.poll()
            if code is None:
                running.append(w)
            elif code != 0:
                failed.append(w)
        return failed, running

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def stop(self, grace: float, sig: int = signal.SIGTERM) -> None:
        """``sig`` to every worker's process group, SIGKILL what is left after ``grace``.

        Process groups are signalled even when their leader already exited, so that
        processes a worker started do not outlive it.
        """
        for w in self.workers:
            _signal_group(w.proc.pid, sig)
        deadline = time.monotonic() + grace
        for w in self.workers:
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for w in self.workers:
            _signal_group(w.proc.pid, signal.SIGKILL)
            w.proc.wait()
        for w in self.workers:
            for t in w.threads:
                t.join(1.0)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
