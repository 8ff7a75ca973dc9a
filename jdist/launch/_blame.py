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
  any peer can notice the process is gone. The same file is the worker's
  ``TORCHELASTIC_ERROR_FILE``, and the record is also in torch's shape (``message``:
  ``{"message": "Type: text", "extraInfo": {"py_callstack", "timestamp"}}``): what
  ``torch.distributed.elastic``'s ``@record`` (or a program's own handler) wrote there
  is kept, and read back as the rank's record.
- ``<file>.fault``: :mod:`faulthandler`'s Python stack on a fatal signal (SIGABRT,
  SIGSEGV, ...); the file's modification time is when the signal came. Only where the
  program did not enable faulthandler itself.

The launcher's rule (:func:`first_failure`): every rank with a record, and every rank
that exited non-zero, is a candidate; its time is the record's time, the fatal signal's
time, or else (killed by SIGKILL, ``os._exit``) the last moment it was seen running.
The earliest candidate is the first failure; the others are reported as what followed.
Times are wall-clock: across nodes they are as good as the nodes' clock sync.

When the job fails for good and the launcher's own environment names a
``TORCHELASTIC_ERROR_FILE`` (a scheduler that reads it, as torchrun's parent would), the
first failure's record is copied there in torch's shape with its ``errorCode``
(:func:`reply_to_parent`), as torchrun's ``@record``-decorated main does.
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

from jdist.errors import PeerFailedError

__all__ = ["ERROR_FILE_VAR", "TORCH_ERROR_FILE_VAR", "error_file_env", "recording_failures",
           "read_record", "Candidate", "candidate", "first_failure", "reply_to_parent"]

ERROR_FILE_VAR = "JDIST_ERROR_FILE"
TORCH_ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"  # torch's name for the same file
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


def error_file_env(path: str) -> dict[str, str]:
    """The variables that name a worker's failure record ``path``: jdist's and torch's
    (``TORCHELASTIC_ERROR_FILE``, where torch's ``@record`` writes), one file."""
    return {ERROR_FILE_VAR: path, TORCH_ERROR_FILE_VAR: path}


def _torch_message(kind: type, exc: BaseException, tb: str, when: float) -> dict[str, Any]:
    """``exc`` as torch's error handler words it (``ErrorHandler.record_exception``)."""
    return {"message": f"{kind.__name__}: {exc}",
            "extraInfo": {"py_callstack": tb, "timestamp": str(int(when))}}


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_record(path: str, exc: BaseException) -> None:
    """Write ``exc``'s record to ``path`` atomically; never raises (the original
    exception must go on unmasked). A torch-shaped ``message`` the program wrote there
    itself (``@record``, its own handler) is kept; jdist's fields join it."""
    try:
        when = time.time()
        tb = "" if isinstance(exc, SystemExit) else _format(exc)
        kind = type(exc)
        name = kind.__qualname__ if kind.__module__ == "builtins" else (
            f"{kind.__module__}.{kind.__qualname__}")
        written = _read_json(path)
        message = written["message"] if written and "message" in written and (
            "time" not in written) else _torch_message(kind, exc, tb, when)
        record = {"message": message, "time": when, "type": name, "text": str(exc),
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
    """The failure record at ``path`` (None: none written, or unreadable) with jdist's
    fields ``time``, ``type``, ``text``, ``traceback``, ``exit_code``; a record only in
    torch's shape (the program's ``@record``, no jdist fields) gets them from its
    ``message``, and ``own`` False (it counts only once the process exited non-zero)."""
    record = _read_json(path)
    if record is None:
        return None
    if "time" in record:
        return {**record, "own": True}
    message = record.get("message")
    if not isinstance(message, dict):
        return None
    info = message.get("extraInfo") if isinstance(message.get("extraInfo"), dict) else {}
    text = str(message.get("message", ""))
    kind, sep, rest = text.partition(": ")
    if not sep or not kind.replace(".", "").isidentifier():
        kind, rest = "", text
    try:
        when = float(info.get("timestamp"))
    except (TypeError, ValueError):
        when = os.stat(path).st_mtime if os.path.exists(path) else 0.0
    code = message.get("errorCode")
    return {**record, "own": False, "time": when, "type": kind, "text": rest,
            "traceback": str(info.get("py_callstack", "")),
            "exit_code": code if isinstance(code, int) and code else 1}


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
    error_type: str = ""  # the raised exception's qualified name, from the record


def candidate(rank: int, path: str | None, returncode: int | None, seen_alive: float,
              describe) -> Candidate | None:
    """Rank ``rank``'s failure, from its files at ``path`` (None: it has none) and its
    ``returncode`` (None: still running) and the last time it was seen running; None
    if it has not failed. ``describe(returncode)`` words an exit."""
    record = read_record(path) if path else None
    if record is not None and not record["own"] and not returncode:
        record = None  # the program's own file; it failed only once it exits non-zero
    if record is not None:
        code = int(record.get("exit_code", 1))
        if record.get("traceback"):
            message = str(record.get("text", "")).strip().splitlines() or [""]
            text = message[0][:_MESSAGE_CHARS]
            how = f"raised {record.get('type', 'an exception')}" + (f": {text}" if text
                                                                      else "")
        else:
            how = describe(code)
        return Candidate(float(record["time"]), rank, how,
                         str(record.get("traceback", "")), code,
                         str(record.get("type", "")) if record.get("traceback") else "")
    if returncode is None or returncode == 0:
        return None
    fault = _read_fault(path + _FAULT) if path and returncode < 0 else None
    if fault is not None:
        return Candidate(fault[0], rank, describe(returncode), fault[1], None)
    return Candidate(seen_alive, rank, describe(returncode), "", None)


def _consequence(c: Candidate) -> bool:
    """Whether ``c`` raised because a peer died (``PeerFailedError``): never the cause
    while another rank failed too. A rank killed by a signal is known by the time the
    launcher saw it running last, which can come after its peer's error: a forked
    rank's exit reaches the launcher through its fork server, up to ~0.1 s late."""
    return c.error_type.rpartition(".")[2] == PeerFailedError.__name__


def first_failure(candidates: list[Candidate]) -> tuple[Candidate, list[Candidate]]:
    """The earliest candidate (ties: the lower rank) that is not a consequence of a
    dead peer, and the rest in that order."""
    ordered = sorted(candidates, key=lambda c: (_consequence(c), c.time, c.rank))
    return ordered[0], ordered[1:]


def _parent_message(failure: Any) -> dict[str, Any]:
    """A torch-shaped ``message`` for a failure without a record here (a signal, or a
    rank of another node: its launcher sent what it knew)."""
    how = str(failure.how)
    text = how[len("raised "):] if how.startswith("raised ") else f"rank {failure.rank} {how}"
    return {"message": text, "extraInfo": {"py_callstack": failure.traceback or
                                           failure.stderr_tail,
                                           "timestamp": str(int(failure.time or time.time()))}}


def reply_to_parent(environ: Mapping[str, str], failure: Any, error_dir: str | None) -> None:
    """Copy the job's first ``failure`` (``_worker_group.Failure``) to the launcher's own
    ``TORCHELASTIC_ERROR_FILE``, if its environment names one, as torchrun does: the
    failed rank's record (``error_dir/attempt_A/rank_R.json``, when the rank ran on this
    node: ``error_dir`` not None) in torch's shape with ``errorCode`` set to the exit
    code; a failure without a record is worded from what the launcher knows. Never
    raises: the launcher's exit code is the news."""
    dest = environ.get(TORCH_ERROR_FILE_VAR)
    if not dest or failure.rank < 0:
        return
    record = None
    if error_dir is not None:
        record = _read_json(os.path.join(error_dir, f"attempt_{failure.attempt}",
                                         f"rank_{failure.rank}.json"))
    message = record.get("message") if record else None
    if isinstance(message, dict):
        message = dict(message)
    elif not isinstance(message, str):  # (a str: torch's newer format, copied as it is)
        message = _parent_message(failure)
    if failure.exit_code and isinstance(message, dict):
        message["errorCode"] = int(failure.exit_code)
    try:
        tmp = f"{dest}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"message": message}, f)
        os.replace(tmp, dest)
    except OSError:
        pass
