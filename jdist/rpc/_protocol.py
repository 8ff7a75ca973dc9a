"""RPC messages: NamedTuples <-> frames ``[msgpack header, pickle payload, *buffers]``.

The header is msgpack (safe to decode from anyone); only its ``kind`` decides whether a
pickle payload follows. Control messages (RRef fork bookkeeping, pings) carry ints only
and have no payload. A malformed header raises :class:`ProtocolError` and the agent
answers or drops it; it never takes a worker down.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack

from jdist.errors import WorkerNameError

__all__ = [
    "Kind",
    "ControlOp",
    "NOTE_OPS",
    "WorkerInfo",
    "check_worker_name",
    "Call",
    "Remote",
    "Result",
    "Failure",
    "Control",
    "ProtocolError",
    "encode",
    "decode_header",
    "NO_CONTEXT",
]

NO_CONTEXT = -1  # dist-autograd context id carried by calls made outside any context


class _WorkerInfo(NamedTuple):
    id: int
    name: str


class WorkerInfo(_WorkerInfo):
    """A worker's rank (``id``) and unique ``name``.

    ``WorkerInfo(id, name)``; torch's order ``WorkerInfo(name, id)`` is accepted too
    (told apart by the types). The name follows torch's rule.

    Raises:
      WorkerNameError: a name torch refuses (a ``RuntimeError``, with torch's words).
    """

    __slots__ = ()

    def __new__(cls, id: Any, name: Any) -> WorkerInfo:  # noqa: A002 - torch's field
        if isinstance(id, str) and not isinstance(name, str):
            id, name = name, id
        check_worker_name(name)
        return super().__new__(cls, id, name)

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"

    __str__ = __repr__


_NAME = re.compile(r"^[A-Za-z0-9_\-:.]*$")


def check_worker_name(name: Any) -> str:
    """Validate a worker name (torch's rule, plus ``.``): 1-128 of ``[A-Za-z0-9_-:.]``.

    Raises:
      WorkerNameError: the name is not a str, empty, too long or has other characters.
    """
    if not isinstance(name, str):
        raise WorkerNameError(f"worker name must be a str, got {name!r}")
    if not name:
        raise WorkerNameError("Worker name must be non-empty: give every worker a worker name such "
                              "as 'worker0'")
    if not _NAME.match(name):
        raise WorkerNameError(f"Worker name must match ^[A-Za-z0-9-_:]*$, got {name!r}: a "
                              "worker name has letters, digits, '-', '_', ':' (jdist also "
                              "allows '.')")
    if len(name) > 128:
        raise WorkerNameError(f"Worker name must be shorter than 128 characters, got "
                              f"{len(name)}: {name[:20]!r}...")
    return name


class Kind(enum.IntEnum):
    CALL = 1
    REMOTE = 2
    RESULT = 3
    FAILURE = 4
    CONTROL = 5


class ControlOp(enum.IntEnum):
    PING = 0
    FORK_REQUEST = 1  # child user -> owner: register my fork (parent awaits CHILD_ACCEPT)
    USER_DELETE = 2  # user -> owner: my fork is gone
    CHILD_ACCEPT = 3  # owner -> parent user: the owner knows your child fork now


#: control ops that need no answer of their own: they travel in a later call's header
#: (``Call.controls``) instead of a Control message
NOTE_OPS = frozenset({ControlOp.USER_DELETE, ControlOp.CHILD_ACCEPT})


class Call(NamedTuple):
    """Run ``fn(*args, **kwargs)`` (payload) and answer with Result/Failure ``rid``.

    ``released``: distributed autograd contexts the caller has released since its last
    call to this worker (they travel with the next call instead of a call of their own);
    ``controls``: RRef control messages for this worker that need no answer of their
    own (``NOTE_OPS``), queued since then, each ``(op, *rref_id, *fork_id)``.
    """

    rid: int
    fn: str  # name, for messages only
    ctx: int = NO_CONTEXT
    released: tuple = ()
    controls: tuple = ()


class Remote(NamedTuple):
    """Like Call, but keep the value on the callee as OwnerRRef ``rref`` (user ``fork``)."""

    rid: int
    fn: str
    rref: tuple[int, int]
    fork: tuple[int, int]
    ctx: int = NO_CONTEXT
    released: tuple = ()  # as Call's
    controls: tuple = ()  # as Call's


class Result(NamedTuple):
    rid: int


class Failure(NamedTuple):
    rid: int


class Control(NamedTuple):
    rid: int
    op: int
    rref: tuple[int, int] = (-1, -1)
    fork: tuple[int, int] = (-1, -1)
    parent: int = -1


_KIND = {Call: Kind.CALL, Remote: Kind.REMOTE, Result: Kind.RESULT, Failure: Kind.FAILURE,
         Control: Kind.CONTROL}
_CLASS = {v: k for k, v in _KIND.items()}
_HAS_PAYLOAD = {Kind.CALL, Kind.REMOTE, Kind.RESULT, Kind.FAILURE}


class ProtocolError(ValueError):
    """A header that is not a valid message; ``rid`` is set when it could be read."""

    def __init__(self, message: str, rid: int | None = None):
        super().__init__(message)
        self.rid = rid


def encode(msg: NamedTuple, payload: bytes | None = None,
           buffers: Sequence[memoryview] = ()) -> list:
    """Frames for ``msg`` (plus its pickle ``payload`` and out-of-band ``buffers``)."""
    kind = _KIND[type(msg)]
    header = msgpack.packb([int(kind), *msg], use_bin_type=True)
    if kind in _HAS_PAYLOAD:
        if payload is None:
            raise ValueError(f"{type(msg).__name__} needs a payload")
        return [header, payload, *buffers]
    return [header]


def _as_pair(v: Any, name: str) -> tuple[int, int]:
    if (not isinstance(v, (list, tuple)) or len(v) != 2
            or not all(isinstance(x, int) for x in v)):
        raise ProtocolError(f"field {name!r} must be a pair of ints, got {v!r}")
    return (v[0], v[1])


def decode_header(frames: Sequence[Any]) -> NamedTuple:
    """The message in ``frames[0]``; checks field types and the frame count.

    Raises:
      ProtocolError: not msgpack, unknown kind, wrong fields, or a missing payload.
    """
    if not frames:
        raise ProtocolError("empty message")
    try:
        raw = msgpack.unpackb(bytes(frames[0]), raw=False, strict_map_key=True)
    except Exception as e:
        raise ProtocolError(f"header is not msgpack: {e}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not all(
            isinstance(x, int) for x in raw[:2]):
        raise ProtocolError(f"header must be [kind, rid, ...], got {raw!r:.200}")
    kind_i, rid = raw[0], raw[1]
    try:
        kind = Kind(kind_i)
    except ValueError:
        raise ProtocolError(f"unknown message kind {kind_i!r}", rid) from None
    cls = _CLASS[kind]
    fields = raw[1:]
    if not len(cls._fields) - len(cls._field_defaults) <= len(fields) <= len(cls._fields):
        raise ProtocolError(f"{cls.__name__} needs {len(cls._fields)} fields, got {fields!r:.200}",
                            rid)
    try:
        msg = cls(*fields)
        if isinstance(msg, Remote):
            msg = msg._replace(rref=_as_pair(msg.rref, "rref"), fork=_as_pair(msg.fork, "fork"))
        if isinstance(msg, Control):
            msg = msg._replace(rref=_as_pair(msg.rref, "rref"), fork=_as_pair(msg.fork, "fork"))
            if not isinstance(msg.op, int) or not isinstance(msg.parent, int):
                raise ProtocolError(f"bad control message {fields!r:.200}", rid)
        if isinstance(msg, (Call, Remote)):
            if not (isinstance(msg.fn, str) and isinstance(msg.ctx, int)
                    and isinstance(msg.released, (list, tuple))
                    and all(isinstance(c, int) for c in msg.released)
                    and isinstance(msg.controls, (list, tuple))
                    and all(isinstance(c, (list, tuple)) and len(c) == 5
                            and all(isinstance(i, int) for i in c) and c[0] in NOTE_OPS
                            for c in msg.controls)):
                raise ProtocolError(f"bad call header {fields!r:.200}", rid)
            msg = msg._replace(released=tuple(msg.released),
                               controls=tuple(tuple(c) for c in msg.controls))
    except ProtocolError:
        raise
    except Exception as e:
        raise ProtocolError(f"bad {cls.__name__} header: {e}", rid) from None
    if kind in _HAS_PAYLOAD and len(frames) < 2:
        raise ProtocolError(f"{cls.__name__} without a payload frame", rid)
    return msg
