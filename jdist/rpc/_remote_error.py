"""Remote exceptions: what a worker sends back, and how the caller re-raises it.

The caller sees the original exception type (when it can be imported and built from a
message) whose message is torch's ``"On WorkerInfo(id=1, name=w1):"`` header, the
original ``repr`` and the remote traceback; otherwise :class:`jdist.errors.RemoteError`.
The original exception object, when it could be unpickled, is in ``remote_exception``.
"""

from __future__ import annotations

import pickle
import traceback
import warnings
from typing import Any

from jdist.errors import RemoteError

__all__ = ["failure_payload", "rebuild_exception"]


def failure_payload(exc: BaseException, worker: Any) -> dict:
    """A picklable description of ``exc`` raised on ``worker``."""
    try:
        blob = pickle.dumps(exc, protocol=5)
        pickle.loads(blob)
    except Exception:
        blob = None
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {"exc": blob, "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "repr": repr(exc), "tb": tb, "worker": repr(worker)}


def _unescape(text: str) -> str:
    """Escapes in the text (the ``repr`` writes a newline as ``\\n``) made real, as
    torch does, so a multi-line message reads as written; non-ASCII text is kept."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escapes such as "\\d" stay as they are
            return text.encode("ascii", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError:
        return text


def rebuild_exception(payload: dict) -> BaseException:
    """The local exception to raise for a remote failure described by ``payload``."""
    text = _unescape(f"On {payload['worker']}:\n{payload['repr']}\n{payload['tb']}")
    original = None
    if payload.get("exc") is not None:
        try:
            original = pickle.loads(payload["exc"])
        except Exception:
            original = None
    exc_type = type(original) if original is not None else None
    new: BaseException
    try:
        new = exc_type(text) if exc_type is not None else RemoteError(text)
    except Exception:
        new = RemoteError(f"{payload['type']}: {text}")
    new.remote_exception = original  # type: ignore[attr-defined]
    new.remote_type = payload["type"]  # type: ignore[attr-defined]
    return new
