"""Which rank failed first: each worker's failure record, and the launcher's choice.

When one rank raises, its peers usually fail soon after, blocked in a collective whose
partner is gone: they raise a peer-lost error, or the runtime aborts them (SIGABRT with
a C++ stack). Which exit the launcher notices first says nothing about the cause: the
rank that raised may still be shutting down its runtime while the others are dead. So
each worker of ``jdist-run`` records when and how it fails, in files the launcher names
in its environment (``JDIST_ERROR_FILE``, one per rank and attempt):

- ``<file>``: an uncaught exception of the script (or ``sys.exit`` with a non-zero
  code): a JSON record with the wall-clock time, the type, the message, the formatted
  traceback and the exit code Python will give. Written atomically when the exception
  leaves the script, before the interpreter shuts down (before ``atexit``), so before
  any peer can notice the process is gone.
- ``<file>.fault``: :mod:`faulthandler`'s Python stack on a fatal signal (SIGABRT,
  SIGSEGV, ...); the file's modification time is when the signal came. Only where the
  program did not enable faulthandler itself.

The launcher's rule (:func:`first_failure`): every rank with a record, and every rank
that exited non-zero, is a candidate; its time is the record's time, the fatal signal's
time, or else (killed by SIGKILL, ``os._exit``) the last moment it was seen running.
The earliest candidate is the first failure; the others are reported as what followed.
Times are wall-clock: across nodes they are as good as the nodes' clock sync.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import time
import traceback
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

__all__ = ["ERROR_FILE_VAR", "recording_failures", "read_record", "Candidate",
           "candidate", "first_failure"]

ERROR_FILE_VAR = "JDIST_ERROR_FILE"
_FAULT = ".fault"
_MESSAGE_CHARS = 300
# the modules between the worker's entry and the user's script (jdist.launch._run_script)
_SHIM_MODULES = frozenset({__name__, "jdist.launch._run_script", "runpy"})
_fault_file = None  # kept open for faulthandler while the worker runs


def _exit_code(exc: BaseException) -> int:
    if isinstance(exc, SystemExit):
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 1


def _format(exc: BaseException) -> str:
    """``exc``'s traceback as Python prints it, less the worker shim's own frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in _SHIM_MODULES:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


def _write_record(path: str, exc: BaseException) -> None:
    """Write ``exc``'s record to ``path`` atomically; never raises (the original
    exception must go on unmasked)."""
    try:
        tb = "" if isinstance(exc, SystemExit) else _format(exc)
        kind = type(exc)
        name = kind.__qualname__ if kind.__module__ == "builtins" else (
            f"{kind.__module__}.{kind.__qualname__}")
        record = {"time": time.time(), "type": name, "message": str(exc),
                  "traceback": tb, "exit_code": _exit_code(exc), "pid": os.getpid()}
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - a record is a courtesy; the exception is the news
        pass


def _enable_fault_file(path: str) -> None:
    global _fault_file
    if faulthandler.is_enabled():
        return  # the program's own choice (PYTHONFAULTHANDLER, -X faulthandler) stands
    try:
        _fault_file = open(path, "w")  # noqa: SIM115 - open while the worker lives
        faulthandler.enable(file=_fault_file, all_threads=True)
    except OSError:
        _fault_file = None


@contextlib.contextmanager
def recording_failures(environ: Mapping[str, str] | None = None) -> Iterator[None]:
    """Around a worker's script: record its uncaught exception (and, through
    faulthandler, its fatal signal) in the files ``JDIST_ERROR_FILE`` names. Does
    nothing where the variable is unset; the exception always goes on."""
    path = (os.environ if environ is None else environ).get(ERROR_FILE_VAR)
    if not path:
        yield
        return
    _enable_fault_file(path + _FAULT)
    try:
        yield
    except BaseException as exc:
        if _exit_code(exc) != 0:
            _write_record(path, exc)
        raise


def read_record(path: str) -> dict[str, Any] | None:
    """The exception record at ``path``, or None (none written, or unreadable)."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "time" in record else None


def _read_fault(path: str) -> tuple[float, str] | None:
    """(time, text) of a fatal signal's stack dump at ``path``, or None."""
    try:
        st = os.stat(path)
        if st.st_size == 0:
            return None
        with open(path, errors="replace") as f:
            return st.st_mtime, f.read()
    except OSError:
        return None


class Candidate(NamedTuple):
    """One rank that failed, as far as the launcher can tell."""

    time: float
    rank: int
    how: str  # "raised ValueError: boom" / "was killed by signal SIGABRT"
    traceback: str  # the Python traceback (or the stack at a fatal signal), or ""
    exit_code: int | None  # Python's code for a record; None: the process decides


def candidate(rank: int, path: str | None, returncode: int | None, seen_alive: float,
              describe) -> Candidate | None:
    """Rank ``rank``'s failure, from its files at ``path`` (None: it has none) and its
    ``returncode`` (None: still running) and the last time it was seen running; None
    if it has not failed. ``describe(returncode)`` words an exit."""
    record = read_record(path) if path else None
    if record is not None:
        code = int(record.get("exit_code", 1))
        if record.get("traceback"):
            message = str(record.get("message", "")).strip().splitlines() or [""]
            text = message[0][:_MESSAGE_CHARS]
            how = f"raised {record.get('type', 'an exception')}" + (f": {text}" if text
                                                                      else "")
        else:
            how = describe(code)
        return Candidate(float(record["time"]), rank, how,
                         str(record.get("traceback", "")), code)
    if returncode is None or returncode == 0:
        return None
    fault = _read_fault(path + _FAULT) if path and returncode < 0 else None
    if fault is not None:
        return Candidate(fault[0], rank, describe(returncode), fault[1], None)
    return Candidate(seen_alive, rank, describe(returncode), "", None)


def first_failure(candidates: list[Candidate]) -> tuple[Candidate, list[Candidate]]:
    """The earliest candidate (ties: the lower rank) and the rest in time order."""
    ordered = sorted(candidates, key=lambda c: (c.time, c.rank))
    return ordered[0], ordered[1:]
