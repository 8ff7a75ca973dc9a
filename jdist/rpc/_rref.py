"""RRefs and distributed reference counting (torch's fork protocol).

An RRef names a value living on its *owner*. The owner keeps one table entry per value
with the set of user forks that still exist (and a count of its own local handles); the
value is deleted when both are empty.

- Owner sends its RRef to a user: the owner records a new fork for that user *before*
  sending (the user's copy is confirmed at once).
- The owner sends its RRef to itself: it pins the value until the message is decoded.
- A user X sends its RRef to the owner: X keeps its own RRef alive (``holds``) until
  the owner has decoded it into a local handle and said so (``CHILD_ACCEPT``); a reply
  travels on another connection than X's later ``USER_DELETE``, so order alone is not
  enough. When the RRef is an argument of X's call (``rpc_*`` or ``remote()``) to the
  owner, the call's reply says it: the owner decodes a call before it answers it, so X
  lets go of its hold when the reply comes (``_BY_REPLY``), and no control message
  travels (torch sends one for every such argument).
- User X sends to user Y: X makes a child fork id and keeps its own RRef alive
  until the owner has registered the child; Y asks the owner (``FORK_REQUEST``), the
  owner registers it, confirms to Y and tells X (``CHILD_ACCEPT``), and X lets go.
- A user RRef that is garbage-collected tells the owner (``USER_DELETE``).

``USER_DELETE`` and ``CHILD_ACCEPT`` need no answer: they travel in the header of the
next call to their worker, or in a call of their own soon after
(``CallClient.control_note``; the receiver applies them with :meth:`handle_control`).

Incoming messages are decoded in order on each agent's I/O thread, so a value carried
in a message is always registered before a later deletion from the same sender is seen.
A worker that dies loses its forks on every owner.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, NamedTuple

from jdist.errors import RpcTimeoutError, RRefError
from jdist.rpc._agent_api import AgentApi
from jdist.rpc._futures import Future
from jdist.rpc._protocol import ControlOp, WorkerInfo

__all__ = ["RRef", "RRefContext", "rref_fetch", "rref_method_call"]

Id = tuple[int, int]
_NONE: Id = (-1, -1)
_PINNED = -2  # RRefPid.parent: the owner sent its own RRef to itself and pinned it
_BY_REPLY = -3  # RRefPid.parent: a user's argument to its owner, released by the reply


class _Owned:
    __slots__ = ("future", "forks", "handles", "created", "deleted_early")

    def __init__(self, future: Future, created: bool = True):
        self.future = future
        self.forks: dict[Id, int] = {}  # fork id -> worker holding it
        self.handles = 0  # live owner-side RRef objects
        #: False for a placeholder: a message used the RRef before the ``Remote`` that
        #: creates it arrived (they travel on different connections); never deleted
        self.created = created
        self.deleted_early: set[Id] = set()  # USER_DELETEs seen before their fork


class RRefPid(NamedTuple):
    """What travels in a pickle in place of an RRef."""

    owner: int
    rref: Id
    fork: Id
    parent: int


_TOMBSTONES = 1 << 16  # ids of deleted values remembered (to name a use after delete)


class RRefContext:
    """One agent's owner table, child holds and fork bookkeeping (thread-safe)."""

    def __init__(self, agent: AgentApi):
        self.agent = agent
        # re-entrant: dropping a value may drop RRefs inside it, whose __del__ re-enters
        self.lock = threading.RLock()
        self.owned: dict[Id, _Owned] = {}
        # child fork -> (our RRef kept alive until the owner knows the child, receiver)
        self.holds: dict[Id, tuple[RRef, int]] = {}
        self._ids = itertools.count()
        self._deleted: dict[Id, None] = {}  # insertion-ordered, at most _TOMBSTONES
        #: (rref id, method name) -> what the owner said it is (the value never changes)
        self.method_kinds: dict[tuple[Id, str], tuple[str, str]] = {}

    def new_id(self) -> Id:
        return (self.agent.info.id, next(self._ids))

    def _new_future(self, rref_id: Id) -> Future:
        return Future(_executor=getattr(self.agent, "_executor", None),
                      _desc=f"value of RRef {rref_id}")

    # ---- owner side ----
    def create_owned(self, rref_id: Id, fork: Id | None = None, holder: int = -1) -> _Owned:
        """The entry of a value this worker starts to own (a ``Remote`` call, or
        ``RRef(value)``); takes over a placeholder made by an earlier use of the id."""
        with self.lock:
            entry = self.owned.get(rref_id)
            if entry is None:
                entry = self.owned[rref_id] = _Owned(self._new_future(rref_id))
            entry.created = True
            if fork is None:
                return entry  # the caller takes a local handle at once
            if fork in entry.deleted_early:  # the user dropped it before it got here
                entry.deleted_early.discard(fork)
                self._maybe_delete(rref_id, entry)
            else:
                entry.forks[fork] = holder
        return entry

    def _entry_for_use(self, rref_id: Id, what: str) -> _Owned:
        """The entry of ``rref_id`` for a message that uses it (under ``self.lock``).

        torch's getOrCreateOwnerRRef: a use can overtake the ``Remote`` that creates the
        value when the two come from different workers (the creator sent the RRef on
        before its ``Remote`` was read here), so an unknown id made elsewhere gets a
        placeholder whose value the ``Remote`` fills in later.

        Raises:
          RRefError: the value was deleted already, or was made here and is gone.
        """
        entry = self.owned.get(rref_id)
        if entry is not None:
            return entry
        if rref_id in self._deleted or rref_id[0] == self.agent.info.id:
            raise RRefError(f"RRef {rref_id} no longer exists on its owner "
                            f"{self.agent.info}: every reference to it was dropped ({what})")
        entry = self.owned[rref_id] = _Owned(self._new_future(rref_id), created=False)
        return entry

    def _maybe_delete(self, rref_id: Id, entry: _Owned) -> None:
        if entry.created and not entry.forks and entry.handles <= 0:
            if self.owned.pop(rref_id, None) is not None:
                self._deleted[rref_id] = None
                if len(self._deleted) > _TOMBSTONES:
                    del self._deleted[next(iter(self._deleted))]

    def handle_acquired(self, rref_id: Id) -> _Owned:
        with self.lock:
            entry = self._entry_for_use(rref_id, "local handle")
            entry.handles += 1
            return entry

    def handle_released(self, rref_id: Id) -> None:
        with self.lock:
            entry = self.owned.get(rref_id)
            if entry is not None:
                entry.handles -= 1
                self._maybe_delete(rref_id, entry)

    def drop_holder(self, worker: int) -> None:
        """A worker is gone: forget every fork it held (its RRefs died with it), and
        the holds waiting for it (as receiver or as owner)."""
        with self.lock:
            orphans = []
            for rref_id, entry in list(self.owned.items()):
                for fork in [f for f, h in entry.forks.items() if h == worker]:
                    del entry.forks[fork]
                if not entry.created and rref_id[0] == worker:  # its Remote never came
                    entry.created = True
                    orphans.append(entry.future)
                self._maybe_delete(rref_id, entry)
            gone = [c for c, (r, dest) in self.holds.items()
                    if dest == worker or r._owner.id == worker]
            dropped = [self.holds.pop(c) for c in gone]
        del dropped
        for fut in orphans:
            if not fut.done():
                fut.set_exception(RRefError(
                    f"worker {worker} died before the remote() call that makes this RRef "
                    "reached its owner"))

    def handle_control(self, op: int, rref_id: Id, fork: Id, parent: int, peer: int) -> None:
        """Apply a control message from ``peer`` (called on the I/O thread).

        Raises:
          RRefError: the op refers to an RRef this worker does not own.
        """
        if op == ControlOp.PING:
            return
        if op == ControlOp.CHILD_ACCEPT:
            with self.lock:
                held = self.holds.pop(fork, None)
            del held  # may send our own USER_DELETE (queued, in order)
            return
        with self.lock:
            if op == ControlOp.FORK_REQUEST:
                entry = self._entry_for_use(rref_id, "fork request")
                if fork in entry.deleted_early:
                    entry.deleted_early.discard(fork)
                else:
                    entry.forks[fork] = peer
            elif op == ControlOp.USER_DELETE:
                entry = self.owned.get(rref_id)
                if entry is None and rref_id not in self._deleted:
                    entry = self._entry_for_use(rref_id, "user delete")
                if entry is not None:
                    if entry.forks.pop(fork, None) is None:
                        entry.deleted_early.add(fork)  # its fork request comes later
                    self._maybe_delete(rref_id, entry)
            else:
                raise RRefError(f"unknown RRef control op {op}")
        if op == ControlOp.FORK_REQUEST and parent >= 0:
            self.agent.control_note(parent, ControlOp.CHILD_ACCEPT, rref_id, fork)

    # ---- pickling ----
    def persistent_id(self, obj: RRef, dest: int) -> RRefPid:
        """What to send instead of ``obj`` to worker ``dest`` (records forks/holds)."""
        if obj._agent is not self.agent:
            raise RRefError("an RRef can only be sent by the agent that made it")
        me = self.agent.info.id
        if obj._owner.id == me:
            with self.lock:
                entry = self.owned[obj._rref_id]
                if dest == me:  # to ourselves: pin until the message is decoded
                    entry.handles += 1
                    return RRefPid(me, obj._rref_id, _NONE, _PINNED)
                fork = self.new_id()
                entry.forks[fork] = dest
            return RRefPid(me, obj._rref_id, fork, -1)
        # a user's RRef (to the owner or to another user): keep ours alive until the
        # owner has the new reference (CHILD_ACCEPT, or the reply of the call that
        # carries it to the owner), whatever connection carries it
        child = self.new_id()
        with self.lock:
            self.holds[child] = (obj, dest)
        by_reply = getattr(_encoding, "by_reply", None)
        if by_reply is not None and dest == obj._owner.id:
            by_reply.append(child)
            return RRefPid(obj._owner.id, obj._rref_id, child, _BY_REPLY)
        return RRefPid(obj._owner.id, obj._rref_id, child, me)

    def release_holds(self, children: list[Id]) -> None:
        """The owner has the RRefs sent as ``children`` (the reply of the call that
        carried them came): let go of ours."""
        with self.lock:
            held = [self.holds.pop(c, None) for c in children]
        del held  # may send our own USER_DELETEs (queued, in order)

    def persistent_load(self, pid: Any) -> RRef:
        """The RRef for a received :class:`RRefPid` (sends the protocol's messages)."""
        owner, rref_id, fork, parent = RRefPid(*pid)
        rref_id, fork = tuple(rref_id), tuple(fork)
        info = self.agent.worker_info(owner)
        me = self.agent.info.id
        if owner == me:
            rref = RRef._make(self.agent, info, rref_id, None, True)
            if parent == _PINNED:
                self.handle_released(rref_id)
            elif parent >= 0:
                self.agent.control_note(parent, ControlOp.CHILD_ACCEPT, rref_id, fork)
            return rref  # _BY_REPLY: our reply to the call tells the sender
        if parent == _BY_REPLY:
            raise RRefError(f"RRef {rref_id} was sent to {self.agent.info} as if it were "
                            f"its owner; its owner is {info}")
        rref = RRef._make(self.agent, info, rref_id, fork, parent < 0)
        if parent >= 0:
            ack = self.agent.send_control(owner, ControlOp.FORK_REQUEST, rref_id, fork, parent)
            ack.add_done_callback(rref._on_confirmed)
            pending = getattr(_decoding, "acks", None)
            if pending is not None:  # a call's argument: it runs once the owner confirmed
                pending.append(ack)
        return rref


_decoding = threading.local()  # .acks: fork confirmations a call being decoded waits for
_encoding = threading.local()  # .by_reply: user RRefs a call being encoded sends to owners


def collect_reply_holds(children: list | None) -> list | None:
    """Start (``[]``) or end (``None``) collecting, in this thread, the user RRefs that
    the call being encoded sends to their owner (released by its reply); returns the
    previous list."""
    prev = getattr(_encoding, "by_reply", None)
    _encoding.by_reply = children
    return prev


def collect_fork_acks(acks: list | None) -> list | None:
    """Start (``[]``) or end (``None``) collecting the fork confirmations of the RRefs
    decoded in this thread; returns the previous list."""
    prev = getattr(_decoding, "acks", None)
    _decoding.acks = acks
    return prev


class RRef:
    """A reference to a value owned by some worker (``RRef(value)``: owned here).

    Methods follow ``torch.distributed.rpc.RRef``. An RRef can be pickled only as an
    argument or result of an RPC.
    """

    def __init__(self, value: Any, type_hint: Any = None):
        del type_hint
        from jdist.rpc._state import current_agent

        self._init_owned(current_agent(), value)

    @classmethod
    def owned_by(cls, agent: AgentApi, value: Any) -> RRef:
        """``RRef(value)`` owned by ``agent`` (for code that has an agent in hand, e.g.
        several agents in one process)."""
        self = cls.__new__(cls)
        self._init_owned(agent, value)
        return self

    def _init_owned(self, agent: AgentApi, value: Any) -> None:
        rref_id = agent.rrefs.new_id()
        agent.rrefs.create_owned(rref_id).future.set_result(value)
        self._init(agent, agent.info, rref_id, None, True)

    @classmethod
    def _make(cls, agent: AgentApi, owner: WorkerInfo, rref_id: Id, fork: Id | None,
              confirmed: bool) -> RRef:
        self = cls.__new__(cls)
        self._init(agent, owner, rref_id, fork, confirmed)
        return self

    def _init(self, agent: AgentApi, owner: WorkerInfo, rref_id: Id, fork: Id | None,
              confirmed: bool) -> None:
        self._agent = agent
        self._owner = owner
        self._rref_id = rref_id
        self._fork = fork
        self._confirmed = confirmed
        self._created: Future | None = None  # set by remote(): the owner's answer
        self._prefetched: Future | None = None  # prefetch(): the next fetch's answer
        self._entry = None
        self._live = False
        if owner.id == agent.info.id:
            self._entry = agent.rrefs.handle_acquired(rref_id)
        self._live = True

    def __repr__(self) -> str:  # torch's format
        if self.is_owner():
            return f"OwnerRRef({_gid(self._rref_id)})"
        return f"UserRRef(RRefId = {_gid(self._rref_id)}, ForkId = {_gid(self._fork)})"

    def __reduce__(self):
        raise RRefError("an RRef can only be pickled as an argument or result of "
                        "rpc_sync/rpc_async/remote")

    def __del__(self) -> None:
        if not getattr(self, "_live", False):
            return
        self._live = False
        # __del__ can run inside any code (even while a lock is held in this thread), so
        # it only queues the release; the agent's release thread does the work.
        try:
            if self._owner.id == self._agent.info.id:
                self._agent.released.put(("owner", self._rref_id))
            elif self._fork is not None:
                self._agent.released.put(("user", self._owner.id, self._rref_id, self._fork))
        except Exception:  # interpreter shutting down
            pass

    def _get_future(self, timeout: float = -1) -> Future:
        """torch's private ``_get_future``: the future of the ``remote()`` call that made
        this RRef (completed at once for an RRef that did not come from ``remote()``)."""
        del timeout
        if self._created is not None:
            return self._created
        fut: Future = Future(_desc=f"creation of {self!r}")
        fut.set_result(None)
        return fut

    def _on_confirmed(self, fut: Future) -> None:
        if fut.exception() is None:
            self._confirmed = True

    def is_owner(self) -> bool:
        """Whether this worker owns the value."""
        return self._owner.id == self._agent.info.id

    def owner(self) -> WorkerInfo:
        """The owner's WorkerInfo."""
        return self._owner

    def owner_name(self) -> str:
        """The owner's worker name."""
        return self._owner.name

    def confirmed_by_owner(self) -> bool:
        """Whether the owner knows about this reference (always True on the owner)."""
        return self.is_owner() or self._confirmed

    def local_value(self, timeout: float = -1) -> Any:
        """The value itself; only on the owner (waits while ``remote`` still runs it).

        Raises:
          RRefError: called on a user (torch's message names both workers).
        """
        if not self.is_owner():
            raise RRefError(
                f"For UserRRef(rref_id={_gid(self._rref_id)}, fork_id={_gid(self._fork)}), "
                f"can't call localValue() on user {self._agent.info}. "
                f"Call it on owner {self._owner}")
        from jdist.rpc._options import resolve_timeout

        return self._entry.future.wait(
            resolve_timeout(timeout, self._agent.options.rpc_timeout))

    def to_here(self, timeout: float = -1) -> Any:
        """A copy of the value, fetched from the owner (blocking).

        Raises:
          the error of the ``remote`` call that made the value, if it failed;
          RpcTimeoutError: the fetch took longer than ``timeout`` (-1: default, 0: none).
        """
        if self.is_owner() and getattr(self, "_ad_link", None) is None:
            return self.local_value(timeout)
        created = self._created
        if created is not None and created.done() and isinstance(created.exception(),
                                                                 RpcTimeoutError):
            raise RpcTimeoutError(
                f"RRef creation via rpc.remote() timed out, and it is possible that the RRef "
                f"on the owner node does not exist: {created.exception()}") from None
        # (an owner's RRef to a differentiable value goes through the agent's call hook)
        return self._fetch(timeout).wait()

    def _fetch(self, timeout: float = -1) -> Future:
        """A fetch of the value from the owner: the one :meth:`_prefetch` started, if
        any (used once), else a new one."""
        fut, self._prefetched = self._prefetched, None
        if fut is None:
            fut = self._agent.rpc_async(self._owner, rref_fetch, (self,), None, timeout)
        return fut

    def _prefetch(self) -> None:
        """Start fetching the value now for the next :meth:`to_here` of this (user) RRef:
        a call that arrived with it and must wait its turn before running fetches while
        it waits. The value is the same either way: an RRef's value is never replaced."""
        if not self.is_owner() and self._prefetched is None:
            self._prefetched = self._fetch()

    def rpc_sync(self, timeout: float = -1) -> _Proxy:
        """``rref.rpc_sync().m(*a)`` runs ``local_value().m(*a)`` on the owner."""
        return _Proxy(self, "rpc_sync", timeout)

    def rpc_async(self, timeout: float = -1) -> _Proxy:
        """Like :meth:`rpc_sync` but each method call returns a Future."""
        return _Proxy(self, "rpc_async", timeout)

    def remote(self, timeout: float = -1) -> _Proxy:
        """Like :meth:`rpc_sync` but each method call returns an RRef to its result."""
        return _Proxy(self, "remote", timeout)


def _gid(i: Id | None) -> str:
    return "None" if i is None else f"GloballyUniqueId(created_on={i[0]}, local_id={i[1]})"


class _Proxy:
    """``rref.rpc_sync()`` & co: ``proxy.m(*a)`` runs ``value.m(*a)`` on the owner.

    The first call of a method name asks the owner what it is (cached on the RRef): an
    unknown name raises ``AttributeError`` here, as in torch, and an
    ``@async_execution`` method runs as one (its Future's value is the answer).
    """

    def __init__(self, rref: RRef, how: str, timeout: float):
        self._rref, self._how, self._timeout = rref, how, timeout

    def __getattr__(self, name: str):
        rref, how, timeout = self._rref, self._how, self._timeout
        agent = rref._agent

        def call(*args: Any, **kwargs: Any) -> Any:
            fn = rref_method_call_async if _method_kind(rref, name, timeout) else \
                rref_method_call
            a = (rref, name, args, kwargs)
            if how == "remote":
                return agent.remote(rref.owner(), fn, a, None, timeout)
            fut = agent.rpc_async(rref.owner(), fn, a, None, timeout)
            return fut.wait() if how == "rpc_sync" else fut

        return call


def _method_kind(rref: RRef, name: str, timeout: float) -> bool:
    """Whether ``name`` is an ``@async_execution`` method of the RRef's value.

    Raises:
      AttributeError: the value has no attribute ``name`` (torch's message).
    """
    kinds = rref._agent.rrefs.method_kinds
    kind = kinds.get((rref._rref_id, name))
    if kind is None:
        if rref.is_owner():
            kind = rref_method_kind(rref, name)
        else:
            kind = rref._agent.rpc_async(rref.owner(), rref_method_kind, (rref, name), None,
                                         timeout).wait()
        if len(kinds) > 4096:
            kinds.clear()
        kinds[(rref._rref_id, name)] = kind
    if kind[0] == "missing":
        raise AttributeError(f"'{kind[1]}' object has no attribute '{name}' (called through "
                             f"an RRef proxy of {rref!r})")
    return kind[0] == "async"


def rref_fetch(rref: RRef) -> Future:
    """Owner side of ``to_here``: the value's future (sent back when it completes)."""
    return rref._entry.future


rref_fetch._jdist_async_execution = True  # type: ignore[attr-defined]


def rref_method_call(rref: RRef, name: str, args: tuple, kwargs: dict) -> Any:
    """Owner side of the RRef proxies: ``getattr(value, name)(*args, **kwargs)``."""
    return getattr(rref.local_value(), name)(*args, **kwargs)


def rref_method_call_async(rref: RRef, name: str, args: tuple, kwargs: dict) -> Future:
    """The same for an ``@async_execution`` method: its Future is the answer."""
    return getattr(rref.local_value(), name)(*args, **kwargs)


rref_method_call_async._jdist_async_execution = True  # type: ignore[attr-defined]


def rref_method_kind(rref: RRef, name: str) -> tuple[str, str]:
    """Owner side: ``("missing" | "async" | "sync", type name)`` of ``value.name``."""
    value = rref.local_value()
    tname = type(value).__name__
    attr = getattr(value, name, _MISSING)
    if attr is _MISSING:
        return ("missing", tname)
    return ("async" if getattr(attr, "_jdist_async_execution", False) else "sync", tname)


rref_method_kind._jdist_autograd_internal = True  # type: ignore[attr-defined]
_MISSING = object()
