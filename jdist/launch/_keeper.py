"""No orphans: a keeper process that outlives a launcher and kills what it left behind.

Every child of ``jdist-run`` and :func:`jdist.launch.spawn` dies with its parent
(``PR_SET_PDEATHSIG``, :mod:`~jdist.launch._lifeline`), but that signal reaches only
the child itself: when the launcher is SIGKILLed, the processes its workers started
(data-loader workers, subprocesses) live on with PPID 1. So the first time this process
starts a worker it also starts one keeper (:mod:`~jdist.launch._keeper_main`, a
standard-library script in its own session) and tells it each worker's pid through a
pipe; when this process is gone, however it died, the pipe's end of file makes the
keeper kill the workers' sessions, groups and every process it saw descend from them.

:func:`watch` after a worker starts, :func:`forget` once its group was stopped and it
was reaped. A child forked from this process without ``exec`` does not keep the pipe
open (``os.register_at_fork``), so the keeper sees the end when this process ends.
Where no keeper can start (no ``sys.executable``), workers still die with their parent;
only their own children may stay.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading

__all__ = ["watch", "forget"]

_lock = threading.Lock()
_keeper: subprocess.Popen | None = None
_failed = False


def _start() -> subprocess.Popen | None:
    global _keeper, _failed
    if _keeper is None and not _failed:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_keeper_main.py")
        try:
            _keeper = subprocess.Popen([sys.executable, "-I", "-S", script],
                                       stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                       start_new_session=True, bufsize=0)
        except OSError:
            _failed = True
    return _keeper


def _send(line: str) -> None:
    global _keeper
    with _lock:
        keeper = _start()
        if keeper is None or keeper.stdin is None:
            return
        try:
            keeper.stdin.write(line.encode() + b"\n")
        except OSError:  # the keeper died (someone killed it): start another next time
            _keeper = None


def watch(pid: int) -> None:
    """Have the keeper kill ``pid``'s session and descendants if this process dies."""
    _send(f"+{int(pid)}")


def forget(pid: int) -> None:
    """``pid`` was stopped (its group killed) and reaped: the keeper kills what it left
    outside its group and stops watching it."""
    if _keeper is not None:
        _send(f"-{int(pid)}")


def _after_fork_in_child() -> None:
    global _keeper, _lock
    _lock = threading.Lock()
    if _keeper is not None and _keeper.stdin is not None:
        try:
            _keeper.stdin.close()
        except OSError:
            pass
    _keeper = None


def _at_exit() -> None:
    """Close our end now (the keeper sees the end of file and finishes) rather than
    leave it to the interpreter's teardown."""
    if _keeper is not None and _keeper.stdin is not None:
        try:
            _keeper.stdin.close()
            _keeper.wait(2.0)  # it only checks that nothing watched is left
        except (OSError, subprocess.TimeoutExpired):
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)
