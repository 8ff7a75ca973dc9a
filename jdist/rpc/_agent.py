"""RpcAgent: worker table, connections, request ids, pending futures, executor.

One agent per worker. An asyncio loop in a daemon thread accepts and authenticates
connections and reads messages; incoming messages are decoded in arrival order on each
connection (which keeps RRef bookkeeping ordered), and user functions run on a thread
pool of ``num_worker_threads``. Replies are sent by the thread that produced them.
Outgoing requests are sent by the calling thread on one connection per peer; the reply
completes the request's :class:`Future`. A connection that drops marks its worker dead:
its pending futures fail at once with :class:`WorkerUnavailableError`, and so do new
calls.

Latency: each hand-off between threads is a wake-up, and waking an idle CPU costs tens
of microseconds. So a thread about to wait reads its connection itself for up to
``RpcBackendOptions.busy_poll_us`` (0.2 ms) first (``Comm.poll_until``): a caller
waiting on a reply (``Future.wait``), and a pool thread that has just replied, which
then runs the next call from that connection itself instead of handing it to another
pool thread. A steady stream of calls then needs no wake-up at all. Polling holds the
GIL between reads, so it is skipped for peers in this process and while other threads
of the process run RPC functions.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from jdist.errors import (
    RpcAuthError,
    RpcError,
    RpcTimeoutError,
    UnknownWorkerError,
    WorkerUnavailableError,
)
from jdist.rpc import _protocol as P
from jdist.rpc import _serialize as S
from jdist.rpc._auth import HANDSHAKE_MAX_BYTES, client_handshake, server_handshake
from jdist.rpc._futures import Future, others_running
from jdist.rpc._options import RpcBackendOptions, resolve_timeout
from jdist.rpc._protocol import WorkerInfo
from jdist.rpc._remote_error import failure_payload, rebuild_exception
from jdist.rpc._rref import RRef, RRefContext, collect_fork_acks
from jdist.rpc._serve import CallServer, quiet
from jdist.rpc.transport import Comm, CommClosedError, get_transport, parse_address

__all__ = ["RpcAgent"]

log = logging.getLogger("jdist.rpc")
_HANDSHAKE_TIMEOUT = 10.0


_LOCAL_ADDRESSES: set[str] = set()  # listening addresses of the agents in this process


def same_process(address: str | None) -> bool:
    """Whether ``address`` is an agent of this process (or unknown)."""
    return address is None or address in _LOCAL_ADDRESSES


class _Pending(NamedTuple):
    future: Future
    worker: WorkerInfo
    fn: str
    timeout: float | None


class RpcAgent(CallServer):
    """The RPC runtime of one worker (use :func:`jdist.rpc.init_rpc` normally).

    Args:
      name: unique worker name.
      rank: worker id, 0..world_size-1.
      world_size: number of workers.
      options: :class:`RpcBackendOptions`.
      auth_key: the job's shared secret.
    """

    def __init__(self, name: str, rank: int, world_size: int, options: RpcBackendOptions,
                 auth_key: bytes):
        self.info = WorkerInfo(rank, name)
        self.world_size = world_size
        self.options = options
        self._key = auth_key
        self._transport = get_transport(parse_address(options.listen_on())[0])
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"jdist-rpc-io-{name}")
        self._executor = ThreadPoolExecutor(options.num_worker_threads,
                                            thread_name_prefix=f"jdist-rpc-{name}")
        self._ctl = ThreadPoolExecutor(1, thread_name_prefix=f"jdist-rpc-ctl-{name}")
        self._workers: dict[int, WorkerInfo] = {}
        self._by_name: dict[str, WorkerInfo] = {}
        self._addresses: dict[int, str] = {}
        self._conns: dict[int, Comm] = {}
        self._conn_locks: dict[int, threading.Lock] = {}
        self._incoming: set[Comm] = set()
        self._dead: dict[int, str] = {}
        self._pending: dict[int, _Pending] = {}
        self._ctl_pending: set[Future] = set()
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._timers: list[tuple[float, int]] = []
        self._listener = None
        self._timer_task = None
        self.address: str | None = None
        self.store: Any = None  # the rendezvous store (set by start_agent)
        self.state = "new"
        self._ready = threading.Event()  # set once the worker table is installed
        # Messages that arrive before our rendezvous finished wait here, in arrival
        # order, and are dispatched in that order once it has (before any later one):
        # decoding needs the worker table, and a use of an RRef must not overtake the
        # message that creates it.
        self._backlog: list[tuple[Comm, int, list]] = []
        self._backlog_lock = threading.Lock()
        self._closed = threading.Event()  # set when close() has finished
        self._poll_s = options.busy_poll_us * 1e-6
        self.quiet_leaves = False  # set by graceful shutdown once every worker is done
        self.rrefs = RRefContext(self)
        #: RRef releases queued by ``RRef.__del__`` (SimpleQueue.put is reentrant-safe)
        self.released: queue.SimpleQueue = queue.SimpleQueue()
        self._releasing = False
        self._release_thread = threading.Thread(target=self._release_loop, daemon=True,
                                                name=f"jdist-rpc-release-{name}")
        #: dist-autograd hooks (issue 9): context id to send, and a context manager
        #: factory entered around incoming calls with their context id.
        self.context_id_hook: Callable[[], int] | None = None
        self.enter_context_hook: Callable[[int], Any] | None = None
        #: asked first by rpc_async: a Future for a differentiable call, or None
        self.call_hook: Callable[..., Future | None] | None = None
        self.remote_hook: Callable[..., RRef | None] | None = None  # the same for remote()
        from jdist.rpc.autograd._context import install

        install(self)

    def __repr__(self) -> str:
        return f"RpcAgent({self.info}, {self.state}, address={self.address})"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> str:
        """Start the I/O thread and the listener; return the listening address."""
        self._thread.start()
        self._release_thread.start()
        self.address = self._run(self._start(), 30.0)
        _LOCAL_ADDRESSES.add(self.address)
        self.state = "running"
        return self.address

    async def _start(self) -> str:
        self._listener = await self._transport.listen(
            self.options.listen_on(), self._serve, max_message_bytes=HANDSHAKE_MAX_BYTES)
        self._timer_task = self._loop.create_task(self._expire_timers())
        return self._listener.address

    def set_workers(self, table: dict[int, tuple[str, str]]) -> None:
        """Install the rendezvous result: rank -> (name, address)."""
        for rank, (name, address) in table.items():
            info = WorkerInfo(rank, name)
            self._workers[rank] = info
            self._by_name[name] = info
            self._addresses[rank] = address
            self._conn_locks[rank] = threading.Lock()
        with self._backlog_lock:  # later messages wait for the lock, then go in order
            self._ready.set()
            backlog, self._backlog = self._backlog, []
            for comm, peer, frames in backlog:
                try:
                    self._dispatch_now(comm, peer, frames)
                except Exception:
                    log.exception("jdist.rpc: %s failed to handle a message", self.info)

    def _run(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ------------------------------------------------------------------ workers
    def worker_info(self, to: Any = None) -> WorkerInfo:
        """Resolve a worker name, rank or WorkerInfo (None: this worker).

        Raises:
          UnknownWorkerError: unknown name, rank or WorkerInfo (a RuntimeError and a
            ValueError, with torch's "could not find destination"; the message lists the
            known ones).
          ValueError: ``to`` is none of those types (torch's type).
        """
        if to is None:
            return self.info
        if isinstance(to, WorkerInfo):
            if self._workers.get(to.id) != to:
                raise UnknownWorkerError(f"could not find destination {to!r}: unknown worker; "
                                         f"known: {sorted(self._workers.values())}")
            return to
        if isinstance(to, str):
            info = self._by_name.get(to)
            if info is None:
                raise UnknownWorkerError(f"could not find destination: unknown worker name "
                                         f"{to!r}; known: {sorted(self._by_name)}")
            return info
        if isinstance(to, int) and not isinstance(to, bool):
            info = self._workers.get(to)
            if info is None:
                raise UnknownWorkerError(f"could not find destination: unknown worker rank "
                                         f"{to}; ranks are 0..{self.world_size - 1}")
            return info
        raise ValueError(f"Cannot get WorkerInfo from name {to!r}: `to` must be a worker "
                         "name, rank or WorkerInfo")

    def all_workers(self) -> list[WorkerInfo]:
        return [self._workers[r] for r in sorted(self._workers)]

    def _mark_dead(self, rank: int, reason: str) -> None:
        if rank == self.info.id or self.state not in ("running", "stopping"):
            return
        with self._lock:
            if rank in self._dead:
                return
            self._dead[rank] = reason
            failed = [(rid, p) for rid, p in self._pending.items() if p.worker.id == rank]
            for rid, _ in failed:
                del self._pending[rid]
        if not self.quiet_leaves:
            log.warning("jdist.rpc: %s lost worker %s: %s", self.info,
                        self._workers.get(rank), reason)
        for _, p in failed:
            p.future.set_exception(WorkerUnavailableError(
                f"worker {p.worker} is unavailable ({reason}) while {p.fn} was pending on it"))
        self.rrefs.drop_holder(rank)

    # ------------------------------------------------------------------ connections
    def _conn_to(self, rank: int) -> Comm:
        comm = self._conns.get(rank)
        if comm is not None and not comm.closed:
            return comm
        with self._conn_locks[rank]:
            comm = self._conns.get(rank)
            if comm is not None and not comm.closed:
                return comm
            if rank in self._dead:
                raise WorkerUnavailableError(
                    f"worker {self._workers[rank]} is unavailable: {self._dead[rank]}")
            if self.state != "running":
                raise RpcError(f"RPC agent {self.info} is {self.state}; no new calls")
            try:
                comm = self._run(self._connect(rank), self.options.connect_timeout + 5)
            except RpcAuthError:
                raise
            except Exception as e:
                self._mark_dead(rank, f"cannot connect to {self._addresses[rank]}: {e}")
                raise WorkerUnavailableError(
                    f"worker {self._workers[rank]} is unavailable: cannot connect to "
                    f"{self._addresses[rank]} ({e})") from e
            self._conns[rank] = comm
            return comm

    async def _connect(self, rank: int) -> Comm:
        address = self._addresses[rank]
        comm = await self._transport.connect(address, timeout=self.options.connect_timeout,
                                             max_message_bytes=HANDSHAKE_MAX_BYTES)
        try:
            await asyncio.wait_for(client_handshake(comm, self._key, self.info.id, address),
                                   self.options.connect_timeout)
        except BaseException:
            comm.close()
            raise
        comm.set_max_message_bytes(self.options.max_frame_bytes)
        self._start_reading(comm, rank)
        return comm

    async def _serve(self, comm: Comm) -> None:
        try:
            peer = await asyncio.wait_for(server_handshake(comm, self._key), _HANDSHAKE_TIMEOUT)
        except Exception as e:  # wrong secret, garbage, timeout: drop, keep serving
            log.warning("jdist.rpc: %s refused a connection: %s", self.info, e)
            comm.close()
            return
        if peer not in self._workers and self._workers:
            log.warning("jdist.rpc: %s refused a connection claiming unknown rank %s",
                        self.info, peer)
            comm.close()
            return
        comm.set_max_message_bytes(self.options.max_frame_bytes)
        self._incoming.add(comm)
        self._start_reading(comm, peer)

    def _start_reading(self, comm: Comm, peer: int) -> None:
        """Dispatch each message from ``peer`` on the I/O thread; a drop marks it dead."""

        def on_message(frames: list) -> None:
            try:
                self._dispatch(comm, peer, frames)
            except Exception:
                log.exception("jdist.rpc: %s failed to handle a message", self.info)

        def on_close(reason: str) -> None:
            comm.close()
            self._incoming.discard(comm)
            if peer != self.info.id:
                self._mark_dead(peer, reason)

        comm.start_receiving(on_message, on_close)

    # ------------------------------------------------------------------ sending
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
            self._fail(rid, WorkerUnavailableError(f"worker {worker} is unavailable: {e}"))
        except RpcError as e:
            self._fail(rid, e)

    def _encode_call(self, worker: WorkerInfo, msg: Any, func: Any, args: Any,
                     kwargs: Any) -> list:
        name = getattr(func, "__qualname__", "")
        if not callable(func) or "<lambda>" in name or "<locals>" in name:
            S.check_callable_picklable(func, str(worker))
        try:
            payload, bufs = self._dumps((func, tuple(args or ()), dict(kwargs or {})),
                                        worker.id)
        except RpcError:  # an RRef or Future that cannot travel: its own message
            raise
        except Exception as e:
            S.check_callable_picklable(func, str(worker))
            raise TypeError(f"cannot send the arguments of {S.describe_callable(func)} to "
                            f"{worker}: {e}. Pass picklable values (numpy/jax arrays, "
                            "pytrees of them, plain Python objects).") from e
        return P.encode(msg, payload, bufs)

    def _send_timeout(self) -> float | None:
        """Bound on handing one message to a peer that does not read (then it's cut off)."""
        return self.options.rpc_timeout or None

    def _context_id(self) -> int:
        return self.context_id_hook() if self.context_id_hook is not None else P.NO_CONTEXT

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
        frames = self._encode_call(worker, P.Call(rid, fn, self._context_id()), func,
                                   args, kwargs)
        fut = self._register_rid(rid, worker, fn, t, f"rpc_async({worker}, {fn})")
        self._send_request(worker, rid, frames, t)
        comm = self._conns.get(worker.id)
        if comm is not None and self.polls(worker.id):
            fut._poll = functools.partial(self._poll_reply, comm)  # the reply's connection
        return fut

    def polls(self, rank: int) -> bool:
        """Whether a thread waiting for a message from ``rank`` polls first: not for a
        peer in this process (it needs this process's GIL to answer)."""
        return self._poll_s > 0 and not same_process(self._addresses.get(rank))

    def _poll_reply(self, comm: Comm, fut: Future, timeout: float | None) -> None:
        """Before ``fut.wait`` blocks: read the reply's connection in this thread for up
        to ``busy_poll_us``, so a reply that comes soon wakes no thread. Only for a lone
        request (with several in flight the I/O thread is busy anyway, and reads in
        parallel with this thread) and while no other RPC function runs here."""
        if len(self._pending) > 1 or others_running():
            return
        limit = self._poll_s if timeout is None else min(self._poll_s, timeout)
        comm.poll_until(lambda: fut._done or others_running(), limit)

    def _register_rid(self, rid: int, worker: WorkerInfo, fn: str, timeout: float | None,
                      desc: str) -> Future:
        fut: Future = Future(_executor=self._executor, _desc=desc)
        with self._lock:
            if self.state != "running":
                fut.set_exception(RpcError(f"RPC agent {self.info} is {self.state}; "
                                           f"cannot call {fn}"))
                return fut
            self._pending[rid] = _Pending(fut, worker, fn, timeout)
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
        frames = self._encode_call(worker, P.Remote(rid, fn, rref_id, fork, self._context_id()),
                                   func, args, kwargs)
        rref = RRef._make(self, worker, rref_id, fork, False)
        fut = self._register_rid(rid, worker, fn, t, f"remote({worker}, {fn})")
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

    def _release_loop(self) -> None:
        while True:
            item = self.released.get()
            if item is None:
                return
            self._releasing = True
            try:
                if item[0] == "owner":
                    self.rrefs.handle_released(item[1])
                elif self.state == "running":
                    _, owner, rref_id, fork = item
                    self.send_control(owner, P.ControlOp.USER_DELETE, rref_id, fork)
            except Exception:
                log.debug("jdist.rpc: RRef release failed", exc_info=True)
            finally:
                del item
                self._releasing = not self.released.empty()

    def _ctl_done(self, fut: Future) -> None:
        with self._lock:
            self._ctl_pending.discard(fut)

    # ------------------------------------------------------------------ receiving
    def _dispatch(self, comm: Comm, peer: int, frames: list) -> None:
        if not self._ready.is_set():
            with self._backlog_lock:
                if not self._ready.is_set():  # a peer was faster than our rendezvous
                    self._backlog.append((comm, peer, frames))
                    return
        self._dispatch_now(comm, peer, frames)

    def _dispatch_now(self, comm: Comm, peer: int, frames: list) -> None:
        try:
            msg = P.decode_header(frames)
        except P.ProtocolError as e:
            log.warning("jdist.rpc: %s got a bad message from rank %s: %s", self.info, peer, e)
            if e.rid is not None:
                self._reply_failure(comm, e.rid, RpcError(f"bad message: {e}"), peer, "?")
            return
        if isinstance(msg, (P.Result, P.Failure)):
            self._on_reply(msg, frames)
        elif isinstance(msg, P.Control):
            try:
                self.rrefs.handle_control(msg.op, msg.rref, msg.fork, msg.parent, peer)
                frames_out = P.encode(P.Result(msg.rid), *S.dumps(None))
            except Exception as e:
                frames_out = P.encode(P.Failure(msg.rid), *S.dumps(failure_payload(e, self.info)))
            self._ctl_submit(comm.send, frames_out, self._send_timeout())
        else:
            self._on_call(comm, peer, msg, frames)

    def _ctl_submit(self, fn, *args) -> None:
        try:
            self._ctl.submit(quiet, fn, *args)
        except RuntimeError:
            pass

    def _on_reply(self, msg: Any, frames: list) -> None:
        with self._lock:
            p = self._pending.pop(msg.rid, None)
        try:
            body = self._loads(frames)
        except Exception as e:
            body = e
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

    # ------------------------------------------------------------------ shutdown
    def pending_count(self) -> int:
        with self._lock:
            return len(self._pending)

    def drain(self, deadline: float) -> bool:
        """Wait until no request or control message of ours is pending (True) or time is up."""
        while time.monotonic() < deadline:
            with self._lock:
                busy = bool(self._pending) or self._releasing or not self.released.empty()
            if not busy:
                return True
            time.sleep(0.005)
        return False

    def dead_workers(self) -> dict[int, str]:
        return dict(self._dead)

    def probe(self, rank: int) -> bool:
        """Whether worker ``rank`` answers (connecting marks it dead if it cannot)."""
        if rank in self._dead:
            return False
        try:
            self._conn_to(rank)
            return True
        except RpcError:
            return rank not in self._dead

    def close(self) -> None:
        """Tear down at once: fail pending futures, close connections, stop threads."""
        with self._lock:
            if self.state in ("closed", "new"):
                self.state = "closed"
                return
            closing = self.state == "closing"
            self.state = "closing"
            pending, self._pending = self._pending, {}
        with self._backlog_lock:
            self._backlog.clear()  # their senders see the connection close
        if closing:  # another thread is closing: wait for it rather than close twice
            if not self._closed.wait(30.0):
                log.warning("jdist.rpc: %s still closing after 30 s", self.info)
            return
        try:
            self._close(pending)
        finally:
            self._closed.set()

    def _close(self, pending: dict) -> None:
        for p in pending.values():
            p.future.set_exception(RpcError(
                f"RPC agent {self.info} shut down while {p.fn} on {p.worker} was pending"))
        self.released.put(None)
        self._ctl.shutdown(wait=True, cancel_futures=True)
        try:
            self._run(self._aclose(), 10.0)
        except Exception:
            log.exception("jdist.rpc: error while closing %s", self.info)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()
        self._release_thread.join(5.0)
        _LOCAL_ADDRESSES.discard(self.address)
        self.state = "closed"
        with self.rrefs.lock:
            owned, self.rrefs.owned = self.rrefs.owned, {}
            holds, self.rrefs.holds = self.rrefs.holds, {}
        del owned, holds  # dropped outside the lock (their RRefs' __del__ are no-ops now)

    async def _aclose(self) -> None:
        if self._timer_task is not None:
            self._timer_task.cancel()
        if self._listener is not None:
            await self._listener.stop()
        for comm in list(self._conns.values()) + list(self._incoming):
            comm.close()
        await asyncio.sleep(0.01)
