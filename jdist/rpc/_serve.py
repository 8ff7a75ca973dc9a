"""The callee side of the agent: run incoming calls on the thread pool and reply.

Mixed into :class:`jdist.rpc._agent.RpcAgent` (it uses the agent's executor, codecs
and hooks). A remote function's exception is sent back with its traceback; a function
marked ``@async_execution`` frees its thread and the reply goes out when its future
completes. A pool thread that has replied reads the caller's connection for up to
``busy_poll_us`` and runs the next call arriving there itself (still a pool thread: user
code never runs on the I/O loop, and a nested call it makes waits on another connection),
as long as calls from that peer have come soon after such replies (``_pollgate``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from jdist.errors import RpcError
from jdist.rpc import _protocol as P
from jdist.rpc import _serialize as S
from jdist.rpc._futures import (
    Future,
    _in_call,
    add_busy,
    collect_all,
    copy_into,
    others_running,
)
from jdist.rpc._pollgate import WaitFacts, plan_wait
from jdist.rpc._remote_error import failure_payload, rebuild_exception
from jdist.rpc.transport import Comm, CommClosedError

__all__ = ["CallServer", "quiet"]

log = logging.getLogger("jdist.rpc")
_INLINE = threading.local()  # .slot: [] while a pool thread polls for its next call


class CallServer:
    """Callee half of :class:`RpcAgent` (see there for the attributes it uses)."""

    def _on_call(self, comm: Comm, peer: int, msg: Any, frames: list) -> None:
        for op, *ids in msg.controls:  # RRef control messages that came as notes
            try:
                self.rrefs.handle_control(op, tuple(ids[:2]), tuple(ids[2:]), -1, peer)
            except Exception:  # noqa: BLE001 - the call itself still runs
                log.exception("jdist.rpc: RRef control %s %s from rank %s failed",
                              P.ControlOp(op).name, ids, peer)
        if msg.released and self.release_contexts_hook is not None:
            try:  # contexts the caller released before this call (see release_context_on)
                self.release_contexts_hook(msg.released)
            except Exception:  # noqa: BLE001 - the call itself still runs
                log.exception("jdist.rpc: releasing contexts %s from rank %s failed",
                              msg.released, peer)
        waited = self._next_call_waits.pop(peer, None)
        if waited is not None:  # a pool thread began waiting for this call (see below)
            took = time.perf_counter() - waited[1]
            self.poll_gate.record(waited[0], took)
            self.sleep_gate.record(waited[0], took)
        entry = None
        if isinstance(msg, P.Remote):
            entry = self.rrefs.create_owned(msg.rref, msg.fork, peer)
        try:
            (func, args, kwargs), acks = self._loads_call(frames)
        except Exception as e:
            err = RpcError(f"{self.info} could not decode the call of {msg.fn}: {e!r}")
            if entry is not None:
                entry.future.set_exception(err)
            self._reply_failure(comm, msg.rid, err, peer, msg.fn)
            return
        if acks:  # run once the owners have confirmed the RRefs among the arguments
            collect_all(acks).add_done_callback(
                lambda _: self._start_call(comm, peer, msg, entry, func, args, kwargs, False))
            return
        self._start_call(comm, peer, msg, entry, func, args, kwargs, True)

    def _start_call(self, comm: Comm, peer: int, msg: Any, entry: Any, func, args, kwargs,
                    inline_ok: bool) -> None:
        if entry is not None:
            entry.future.add_done_callback(
                lambda f: self._reply_future(comm, msg.rid, f, peer, msg.fn, value=False))
            self._submit_counted(self._run_into, entry.future, func, args, kwargs, msg.fn,
                                 msg.ctx)
        elif inline_ok and getattr(_INLINE, "slot", None) == []:  # a polling pool thread
            add_busy(1)
            _INLINE.slot.append((comm, peer, msg, func, args, kwargs))
        else:  # _run_call counts its calls done itself
            self._submit_busy(self._run_call, comm, peer, msg, func, args, kwargs)

    def _invoke(self, func, args, kwargs, ctx: int):
        _in_call.depth = getattr(_in_call, "depth", 0) + 1  # see others_running
        try:
            if self.enter_context_hook is not None and ctx != P.NO_CONTEXT:
                with self.enter_context_hook(ctx):
                    return func(*args, **kwargs)
            return func(*args, **kwargs)
        finally:
            _in_call.depth -= 1

    def _submit_counted(self, fn, *args) -> None:
        """Run ``fn(*args)`` (one call) on the pool, counted in ``add_busy`` meanwhile."""
        self._submit_busy(_counted, fn, *args)

    def _submit_busy(self, fn, *args) -> None:
        """Count one call in ``add_busy`` and submit ``fn(*args)``, which must uncount it
        (the count is rolled back if the pool refuses the task)."""
        add_busy(1)
        try:
            self._executor.submit(fn, *args)
        except BaseException:
            add_busy(-1)
            raise

    def _run_into(self, fut: Future, func, args, kwargs, fn: str, ctx: int) -> None:
        try:
            out = self._invoke(func, args, kwargs, ctx)
            if getattr(func, "_jdist_async_execution", False):
                _check_async_result(out, fn).add_done_callback(lambda f: copy_into(f, fut))
                return
        except BaseException as e:  # noqa: BLE001 - sent to the caller
            payload = failure_payload(e, self.info)
            _log_user_error(fn, payload)
            fut.set_exception(rebuild_exception(payload))
            return
        fut.set_result(out)

    def _run_call(self, comm: Comm, peer: int, msg: P.Call, func, args, kwargs) -> None:
        """Run a call on this pool thread and reply; then read the caller's connection
        for a little while and run the next call that arrives here too (no hand-off)."""
        while True:  # each call it runs was counted by add_busy(1)
            try:
                replied = self._run_one(comm, peer, msg, func, args, kwargs)
            finally:
                add_busy(-1)
            if not replied:
                return
            nxt = self._poll_next_call(comm, peer, msg.fn)
            if nxt is None:
                return
            comm, peer, msg, func, args, kwargs = nxt

    def _run_one(self, comm: Comm, peer: int, msg: P.Call, func, args, kwargs) -> bool:
        """Run one call and reply; False if the reply waits for an async result."""
        with self._lock:
            self._running_from[peer] = self._running_from.get(peer, 0) + 1
        try:
            try:
                out = self._invoke(func, args, kwargs, msg.ctx)
            finally:
                with self._lock:
                    self._running_from[peer] -= 1
            if getattr(func, "_jdist_async_execution", False):
                _check_async_result(out, msg.fn).add_done_callback(
                    lambda f: self._reply_future(comm, msg.rid, f, peer, msg.fn))
                return False
        except BaseException as e:  # noqa: BLE001 - sent to the caller
            self._reply_failure(comm, msg.rid, e, peer, msg.fn, log_it=True)
            return True
        self._reply(comm, msg.rid, out, peer, msg.fn)
        return True

    def _poll_next_call(self, comm: Comm, peer: int, after: str) -> tuple | None:
        """Read ``comm`` in this thread for the next call from ``peer``; the first call
        read (as ``_run_call``'s arguments) is kept for this thread, others go to the pool.

        First by polling for as long as the gate says (``busy_poll_us``, or up to
        ``busy_poll_max_us`` where cores are spare): not while other threads of this
        process run RPC functions (they need the GIL), nor while the next call from
        ``peer`` after one of ``after`` has come late
        (:class:`~jdist.rpc._pollgate.PollGate`; ``_on_call`` times its arrival either
        way). Then, while such calls have come within ``NEXT_SLEEP_S`` on average
        (``sleep_gate``), no other ``rpc_*`` call from ``peer`` runs here (``remote()``
        values are not counted) and this process has no request of its own in flight
        (a server of busy clients: calls of other peers may run, sleeping holds no
        GIL), by sleeping on the connection
        (``Comm.wait_until``) until a call from ``peer`` arrives, another call of
        ``peer`` starts here, or that time is up: the call then runs in this thread,
        with no hand-off from the I/O thread to the pool."""
        if not self.polls(peer):
            return None
        kind = ("next", peer, after)
        self._next_call_waits[peer] = (kind, time.perf_counter())
        slot: list = []
        _INLINE.slot = slot
        try:
            plan = plan_wait(WaitFacts(False, True, others_running(), True,
                                       self.poll_gate.poll_for(kind)))
            if plan.poll_s > 0:
                comm.poll_until(
                    lambda: bool(slot) or self.state != "running" or others_running(),
                    plan.poll_s)
            if not slot:  # the sleep decided on the facts as they are after the poll
                plan = plan_wait(WaitFacts(
                    False, True, others_running(), not self._pending, 0.0,
                    not self._running_from.get(peer) and self.sleep_gate.should(kind)))
            if not slot and plan.sleep_s > 0:
                comm.wait_until(lambda: bool(slot) or peer not in self._next_call_waits
                                or self.state != "running"
                                or bool(self._running_from.get(peer)), plan.sleep_s)
        finally:
            _INLINE.slot = None
        return slot[0] if slot else None

    def _reply_future(self, comm, rid: int, f: Future, peer: int, fn: str,
                      value: bool = True) -> None:
        exc = f.exception()
        if exc is not None:
            self._reply_failure(comm, rid, exc, peer, fn)
        else:
            self._reply(comm, rid, f.value() if value else None, peer, fn)

    def _reply(self, comm: Comm, rid: int, value: Any, peer: int, fn: str) -> None:
        try:
            frames = P.encode(P.Result(rid), *self._dumps(value, peer))
        except RpcError as e:  # e.g. a Future returned without @async_execution
            self._reply_failure(comm, rid, e, peer, fn)
            return
        except Exception as e:
            self._reply_failure(comm, rid, TypeError(
                f"the result of {fn} on {self.info} cannot be pickled: {e}"), peer, fn)
            return
        quiet(comm.send, frames, self._send_timeout())

    def _reply_failure(self, comm: Comm, rid: int, exc: BaseException, peer: int,
                       fn: str, log_it: bool = False) -> None:
        del peer
        payload = failure_payload(exc, self.info)
        if log_it:
            _log_user_error(fn, payload)
        frames = P.encode(P.Failure(rid), *S.dumps(payload))
        quiet(comm.send, frames, self._send_timeout())


def _log_user_error(fn: str, payload: dict) -> None:
    """A remote function raised: say so on this worker's stderr too, as torch prints it
    (the caller gets the error with the same text)."""
    log.warning("jdist.rpc: %s raised; the caller gets this error:\nOn %s:\n%s\n%s", fn,
                payload["worker"], payload["repr"], payload["tb"])


def _counted(fn, *args) -> None:
    try:
        fn(*args)
    finally:
        add_busy(-1)


def quiet(fn, *args) -> None:
    try:
        fn(*args)
    except CommClosedError as e:
        log.debug("jdist.rpc: dropped a reply: %s", e)


def _check_async_result(out: Any, fn: str) -> Future:
    if not isinstance(out, Future):
        raise RpcError(f"Functions decorated with @rpc.async_function must return a "
                       f"torch.futures.Future object, but got {type(out).__name__}: {fn} is "
                       "decorated with @async_execution and must return a jdist.rpc.Future")
    return out
