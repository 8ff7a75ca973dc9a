"""The caller side of the agent: requests, their futures and deadlines, replies, and
the RRef control messages (sent in order by one thread, acknowledged).

Mixed into :class:`jdist.rpc._agent.RpcAgent` (it uses the agent's connections, worker
table and hooks). ``rpc_async`` pickles ``(func, args, kwargs)`` with RRefs through the
fork protocol, registers a Future and a deadline under a fresh request id and sends the
call from the calling thread; the reply (``_on_reply``, on whichever thread read it)
completes the Future; ``_expire_timers`` fails the ones whose deadline passed.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from typing import Any, NamedTuple

from jdist.errors import RpcError, RpcTimeoutError, WorkerUnavailableError
from jdist.rpc import _protocol as P
from jdist.rpc import _serialize as S
from jdist.rpc._futures import Future, others_running
from jdist.rpc._options import resolve_timeout
from jdist.rpc._pollgate import ReplyWait
from jdist.rpc._protocol import WorkerInfo
from jdist.rpc._remote_error import rebuild_exception
from jdist.rpc._rref import RRef, collect_fork_acks, collect_reply_holds
from jdist.rpc.transport import CommClosedError

__all__ = ["CallClient", "Pending", "same_process", "LOCAL_ADDRESSES"]

log = logging.getLogger("jdist.rpc")


RELEASE_FLUSH_S = 0.02
"""How long a note for a worker (a released distributed autograd context, an RRef control
message that needs no answer) waits for the next call to that worker before a call of its
own carries it (:meth:`CallClient.release_context_on`, :meth:`CallClient.control_note`)."""


def _notes_delivered() -> None:
    """The call that carries notes (released contexts, RRef control messages) when no
    other call went to that worker."""


_notes_delivered._jdist_autograd_internal = True  # never differentiable, never captured

LOCAL_ADDRESSES: set[str] = set()  # listening addresses of the agents in this process


def same_process(address: str | None) -> bool:
    """Whether ``address`` is an agent of this process (or unknown)."""
    return address is None or address in LOCAL_ADDRESSES


class Pending(NamedTuple):
    future: Future
    worker: WorkerInfo
    fn: str
    timeout: float | None


class CallClient:
    """Caller half of :class:`RpcAgent` (see there for the attributes it uses)."""

    def _dumps(self, obj: Any, dest: int) -> tuple[bytes, list]:
        def reduce_rref(r: RRef) -> tuple:
            return S.load_hook, (tuple(self.rrefs.persistent_id(r, dest)),)

        return S.dumps(obj, {RRef: reduce_rref})

    def _loads(self, frames: list) -> Any:
        return S.loads(frames[1], frames[2:], self.rrefs.persistent_load)

    def _loads_call(self, frames: list) -> tuple[Any, list]:
        """Decode a call; also the fork confirmations its RRef arguments wait for (torch
        runs a function only once the owners know every user RRef it was given)."""
        prev = collect_fork_acks([])
        try:
            return self._loads(frames), collect_fork_acks(prev)
        except BaseException:
            collect_fork_acks(prev)
            raise

    def _fail(self, rid: int, exc: BaseException) -> None:
        with self._lock:
            p = self._pending.pop(rid, None)
        if p is not None:
            p.future.set_exception(exc)

    def _send_request(self, worker: WorkerInfo, rid: int, frames: list,
                      timeout: float | None = None) -> None:
        try:
            self._conn_to(worker.id).send(frames, timeout or self._send_timeout())
        except CommClosedError as e:
            self._mark_dead(worker.id, str(e))
            self._release_reply_holds(rid)
            self._fail(rid, WorkerUnavailableError(f"worker {worker} is unavailable: {e}"))
        except RpcError as e:
            self._release_reply_holds(rid)
            self._fail(rid, e)

    def _encode_call(self, worker: WorkerInfo, msg: Any, func: Any, args: Any,
                     kwargs: Any) -> tuple[list, list]:
        """The call's frames, and the forks of the user RRefs among its arguments that
        go to their owner (:meth:`_hold_until_reply` keeps them until the reply)."""
        name = getattr(func, "__qualname__", "")
        if not callable(func) or "<lambda>" in name or "<locals>" in name:
            S.check_callable_picklable(func, str(worker))
        held: list = []
        prev = collect_reply_holds(held)
        try:
            payload, bufs = self._dumps((func, tuple(args or ()), dict(kwargs or {})),
                                        worker.id)
        except RpcError:  # an RRef or Future that cannot travel: its own message
            self.rrefs.release_holds(held)
            raise
        except Exception as e:
            self.rrefs.release_holds(held)
            S.check_callable_picklable(func, str(worker))
            raise TypeError(f"cannot send the arguments of {S.describe_callable(func)} to "
                            f"{worker}: {e}. Pass picklable values (numpy/jax arrays, "
                            "pytrees of them, plain Python objects).") from e
        finally:
            collect_reply_holds(prev)
        if self.notes.any():  # notes since the last call there
            released, controls = self.notes.take(worker.id)
            msg = msg._replace(released=released, controls=controls)
        return P.encode(msg, payload, bufs), held

    # ------------------------------------------------------------------ notes
    def release_context_on(self, to: int, cid: int) -> None:
        """Tell worker ``to`` that distributed autograd context ``cid`` is released: in
        the header of this worker's next call to it, or by a call of its own
        (``_notes_delivered``) if none goes there within ``RELEASE_FLUSH_S``. A
        training loop's next step calls the same workers at once, so its releases cost
        no message (torch sends one per context and worker)."""
        self._note(True, to, cid)

    def control_note(self, to: int, op: int, rref_id: tuple, fork: tuple) -> None:
        """Send worker ``to`` the RRef control message ``op`` (``USER_DELETE``: our user
        RRef ``fork`` of its value ``rref_id`` is gone; ``CHILD_ACCEPT``: the owner
        knows our child fork ``fork`` now) the same way as :meth:`release_context_on`.
        torch sends a message and its acknowledgement for each: a pipeline's micro-batch
        that hands an RRef from one worker to another sent four of them."""
        if op not in P.NOTE_OPS:
            raise ValueError(f"RRef control op {op!r} needs an answer of its own; "
                             f"only {sorted(P.NOTE_OPS)} travel as notes")
        self._note(False, to, (int(op), *rref_id, *fork))

    def _note(self, released: bool, to: int, item: Any) -> None:
        if self.notes.add(released, to, item):
            try:
                self._loop.call_soon_threadsafe(self._loop.call_later, RELEASE_FLUSH_S,
                                                self._flush_notes, to)
            except RuntimeError:  # the loop is closed: the agent is shut down
                pass

    def _flush_notes(self, to: int) -> None:  # on the I/O loop
        age = self.notes.age(to)
        # a younger note than the one this timer was set for (a call took that one) has
        # its own timer: a training loop's notes all travel with its calls
        if age is not None and age >= RELEASE_FLUSH_S - 1e-3:
            self._ctl_submit(self._send_notes, to)

    def send_all_notes(self) -> None:
        """Send every queued note now, each worker's in a call of its own (graceful
        shutdown drains them with the other requests)."""
        for to in self.notes.workers():
            self._send_notes(to)

    def _send_notes(self, to: int) -> None:
        if self.state != "running" or not self.notes.queued(to) or to in self._dead:
            self.notes.take(to)
            return
        try:
            self.rpc_async(to, _notes_delivered).add_done_callback(_log_note_failure)
        except Exception as e:  # noqa: BLE001 - best effort, like torch's release
            log.debug("jdist.rpc: telling worker %s of released contexts and RRef "
                      "changes failed: %s", to, e)

    def _hold_until_reply(self, rid: int, held: list) -> None:
        """Keep the RRefs sent to their owner as ``held`` until request ``rid``'s reply
        (also a late one, after a timeout: the owner may decode the call until then)."""
        if held:
            with self._lock:
                self._reply_holds[rid] = held

    def _release_reply_holds(self, rid: int) -> None:
        with self._lock:
            held = self._reply_holds.pop(rid, None)
        if held:
            self.rrefs.release_holds(held)

    def _send_timeout(self) -> float | None:
        """Bound on handing one message to a peer that does not read (then it's cut off)."""
        return self.options.rpc_timeout or None

    def _context_id(self, to: int) -> int:
        """The distributed autograd context id a message to worker ``to`` carries (the
        hook notes ``to`` as a worker that context has reached)."""
        return self.context_id_hook(to) if self.context_id_hook is not None else P.NO_CONTEXT

    def rpc_async(self, to: Any, func: Any, args: Any = None, kwargs: Any = None,
                  timeout: float | None = -1) -> Future:
        """Send ``func(*args, **kwargs)`` to ``to``; a Future of its result."""
        if self.call_hook is not None:
            fut = self.call_hook(to, func, args, kwargs, timeout)
            if fut is not None:
                return fut
        worker = self.worker_info(to)
        t = resolve_timeout(timeout, self.options.rpc_timeout)
        fn = S.describe_callable(func)
        rid = next(self._ids)
        frames, held = self._encode_call(worker, P.Call(rid, fn, self._context_id(worker.id)), func,
                                         args, kwargs)
        fut = self._register_rid(rid, worker, fn, t, f"rpc_async({worker}, {fn})")
        self._hold_until_reply(rid, held)
        self._send_request(worker, rid, frames, t)
        comm = self._conns.get(worker.id)
        if comm is not None and self.polls(worker.id):  # the reply's connection
            fut.set_waiter(ReplyWait(comm, self.poll_gate, ("reply", worker.id, fn),
                                     lambda: len(self._pending) <= 1, others_running))
        return fut

    def polls(self, rank: int) -> bool:
        """Whether a thread waiting for a message from ``rank`` polls first: not for a
        peer in this process (it needs this process's GIL to answer)."""
        return self._poll_s > 0 and not same_process(self._workers.addresses.get(rank))

    def _register_rid(self, rid: int, worker: WorkerInfo, fn: str, timeout: float | None,
                      desc: str) -> Future:
        fut: Future = Future(_executor=self._executor, _desc=desc)
        with self._lock:
            if self.state != "running":
                fut.set_exception(RpcError(f"RPC agent {self.info} is {self.state}; "
                                           f"cannot call {fn}"))
                return fut
            self._pending[rid] = Pending(fut, worker, fn, timeout)
            if timeout is not None:
                heapq.heappush(self._timers, (time.monotonic() + timeout, rid))
        return fut

    def remote(self, to: Any, func: Any, args: Any = None, kwargs: Any = None,
               timeout: float | None = -1) -> RRef:
        """Run ``func`` on ``to`` and keep the result there; return an RRef to it."""
        if self.remote_hook is not None:
            rref = self.remote_hook(to, func, args, kwargs, timeout)
            if rref is not None:
                return rref
        worker = self.worker_info(to)
        t = resolve_timeout(timeout, self.options.rpc_timeout)
        fn = S.describe_callable(func)
        rref_id = self.rrefs.new_id()
        if worker.id == self.info.id:
            return self._remote_local(rref_id, func, args, kwargs, fn)
        fork = self.rrefs.new_id()
        rid = next(self._ids)
        frames, held = self._encode_call(
            worker, P.Remote(rid, fn, rref_id, fork, self._context_id(worker.id)), func,
            args, kwargs)
        rref = RRef._make(self, worker, rref_id, fork, False)
        fut = self._register_rid(rid, worker, fn, t, f"remote({worker}, {fn})")
        self._hold_until_reply(rid, held)
        rref._created = fut
        fut.add_done_callback(rref._on_confirmed)
        self._send_request(worker, rid, frames, t)
        return rref

    def _remote_local(self, rref_id, func, args, kwargs, fn: str) -> RRef:
        value = self.rrefs.create_owned(rref_id).future
        rref = RRef._make(self, self.info, rref_id, None, True)
        self._executor.submit(self._run_into, value, func, tuple(args or ()),
                              dict(kwargs or {}), fn, P.NO_CONTEXT)
        return rref

    def send_control(self, to: int, op: int, rref_id=(-1, -1), fork=(-1, -1),
                     parent: int = -1) -> Future:
        """Queue an RRef control message (sent in order by one thread); acked Future."""
        worker = self._workers[to]
        rid = next(self._ids)
        fut = self._register_rid(rid, worker, f"rref-control-{P.ControlOp(op).name}",
                                 self.options.rpc_timeout or None, f"control to {worker}")
        with self._lock:
            self._ctl_pending.add(fut)
        fut.add_done_callback(self._ctl_done)
        if not fut.done():
            frames = P.encode(P.Control(rid, int(op), tuple(rref_id), tuple(fork), parent))
            try:
                self._ctl.submit(self._send_request, worker, rid, frames)
            except RuntimeError:
                self._fail(rid, RpcError(f"RPC agent {self.info} is shutting down"))
        return fut

    def _ctl_done(self, fut: Future) -> None:
        with self._lock:
            self._ctl_pending.discard(fut)

    # ------------------------------------------------------------------ replies
    def _on_reply(self, msg: Any, frames: list) -> None:
        with self._lock:
            p = self._pending.pop(msg.rid, None)
        try:
            body = self._loads(frames)
        except Exception as e:
            body = e
        self._release_reply_holds(msg.rid)  # the callee has decoded the call
        if p is None:
            return  # timed out already (any RRefs in it are released by GC)
        if isinstance(body, Exception):
            p.future.set_exception(RpcError(f"could not decode the reply of {p.fn} from "
                                            f"{p.worker}: {body!r}"))
        elif isinstance(msg, P.Result):
            p.future.set_result(body)
        else:
            p.future.set_exception(rebuild_exception(body))

    async def _expire_timers(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            now = time.monotonic()
            expired = []
            with self._lock:
                while self._timers and self._timers[0][0] <= now:
                    _, rid = heapq.heappop(self._timers)
                    p = self._pending.pop(rid, None)
                    if p is not None:
                        expired.append(p)
            for p in expired:
                p.future.set_exception(RpcTimeoutError(
                    f"RPC ran for more than the set timeout ({p.timeout * 1000:g} ms): the "
                    f"RPC to {p.worker} running {p.fn} timed out after {p.timeout:g} s; "
                    "pass a larger timeout= (0 = none) or check that the function is not "
                    "stuck"))


def _log_note_failure(fut: Future) -> None:
    if fut.exception() is not None:
        log.debug("jdist.rpc: telling a worker of released contexts and RRef changes "
                  "failed: %s", fut.exception())
