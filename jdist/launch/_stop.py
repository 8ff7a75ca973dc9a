"""One way to stop child processes: their whole process group, SIGTERM then SIGKILL.

Every child of ``jdist-run`` and :func:`jdist.launch.spawn` runs in its own session
(process group), so signalling the group reaches whatever the child started too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence

from jdist.launch import _keeper

__all__ = ["signal_group", "stop_processes"]


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pgid``; a group that is gone is no error."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_processes(procs: Sequence[subprocess.Popen], grace: float,
                   sig: int = signal.SIGTERM) -> None:
    """``sig`` to each process's group, SIGKILL to the groups after ``grace`` seconds.

    Groups are signalled even when their leader already exited, so that processes a
    child started do not outlive it; what left the group is the keeper's
    (:func:`_keeper.forget`). Returns once every child is reaped.
    """
    for p in procs:
        signal_group(p.pid, sig)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        signal_group(p.pid, signal.SIGKILL)
        p.wait()
        _keeper.forget(p.pid)
