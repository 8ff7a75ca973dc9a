"""What a ``jdist-run`` worker runs before the user's code, in a fresh interpreter
(``python -c``, :func:`jdist.launch._env.worker_command`) or in a process forked from a
preloaded server (``--start-method forkserver``, :mod:`jdist.launch._forkserver`).

1. Die with the parent (the launcher, or the fork server, which dies with it):
   ``PR_SET_PDEATHSIG``, even if it is SIGKILLed, with a polling thread as the fallback
   that also takes the worker's own children (its process group).
2. Run the script or module as ``python script.py args`` / ``python -m module args``
   would: ``sys.argv``, ``sys.path[0]`` (the script's directory, or the working
   directory for a module) and ``__name__ == "__main__"``.
3. Size XLA's CPU client as ``JDIST_XLA_CPU_THREADS`` says (:mod:`jdist._xla_threads`;
   jdist-run sets each process's share of the cores, at least 2, with several processes
   on a node), before the program's first JAX call.
4. Record an uncaught exception (time, type, traceback) and, through faulthandler, a
   fatal signal in the files ``JDIST_ERROR_FILE`` names, so the launcher can tell which
   rank failed first (:mod:`jdist.launch._blame`).
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

from jdist._xla_threads import limit_from_env
from jdist.launch._blame import recording_failures
from jdist.launch._lifeline import die_with_parent

__all__ = ["main"]


def main(argv: Sequence[str]) -> None:
    """``argv``: the parent's pid, ``"script"`` or ``"module"``, the target, its args."""
    parent, mode, target, *args = argv
    die_with_parent(int(parent))
    limit_from_env()
    sys.argv = [target, *args]
    if mode == "module":
        sys.path.insert(0, os.getcwd())
        with recording_failures():
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        if sys.path and sys.path[0] == "":
            del sys.path[0]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        with recording_failures():
            runpy.run_path(target, run_name="__main__")
