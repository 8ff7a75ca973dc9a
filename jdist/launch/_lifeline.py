"""Children that die with their parent: the kernel's parent-death signal, and a
watcher thread for what that signal does not reach.

Its own module so that the package's imports never load the ``python -m`` entry points
(``_spawn_child``, ``_run_script``): runpy warns when the module it runs was imported
first.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

_POLL_S = 0.5


def arm_parent_death_signal() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux's
    ``PR_SET_PDEATHSIG``; elsewhere nothing happens)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except Exception:
        pass


def die_with_parent(parent: int) -> None:
    """Kill this process (group) when process ``parent`` is gone."""
    arm_parent_death_signal()
    if os.getppid() != parent:
        os._exit(137)  # the parent died before the signal was armed

    def watch() -> None:
        while True:
            time.sleep(_POLL_S)
            if os.getppid() != parent:
                try:
                    os.killpg(os.getpgid(0), signal.SIGKILL)
                finally:
                    os._exit(137)

    threading.Thread(target=watch, daemon=True, name="jdist-parent-watch").start()


# A ``--no-python`` worker: arm the parent-death signal (it survives ``exec``), then
# become the program.
_EXEC = ("import os, sys\nfrom jdist.launch._lifeline import die_with_parent\n"
         "die_with_parent(int(sys.argv[1]))\nos.execvp(sys.argv[2], sys.argv[2:])\n")


def exec_command(parent: int, program: str, args: tuple[str, ...] | list[str],
                 python: str | None = None) -> list[str]:
    """The command line of a worker that runs ``program`` (an executable, found as the
    shell would) with ``args`` and dies with process ``parent`` (``jdist-run
    --no-python``)."""
    return [python or sys.executable, "-c", _EXEC, str(parent), program, *args]
