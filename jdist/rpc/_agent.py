"""RpcAgent: one worker's lifecycle and message dispatch, composed of small parts.

Its parts, each with one job and one lock: the worker table (``_workers.WorkerTable``),
the connections (``_connections.Connections``), the queued notes (``_notes.Notes``),
the RRef releaser (``_releaser.Releaser``) and the poll gates (``_pollgate``). One agent
per worker. An asyncio loop in a daemon thread accepts and authenticates
connections and reads messages; incoming messages are dispatched in arrival order on
each connection (which keeps RRef bookkeeping ordered; messages that arrive before our
own rendezvous finished wait in one ordered backlog). The caller side (requests,
replies, deadlines, RRef control messages) is :class:`jdist.rpc._client.CallClient`;
the callee side (running calls on the pool of ``num_worker_threads``, replies) is
:class:`jdist.rpc._serve.CallServer`. A connection that drops marks its worker dead:
its pending futures fail at once with :class:`WorkerUnavailableError`, and so do new
calls. ``close`` tears everything down; graceful shutdown is ``_api.stop_agent``.

Latency: each hand-off between threads is a wake-up, and waking an idle CPU costs tens
of microseconds. So a thread about to wait reads its connection itself for up to
``RpcBackendOptions.busy_poll_us`` first (``Comm.poll_until``): a caller waiting on a
reply (``Future.wait``), and a pool thread that has just replied, which then runs the
next call from that connection itself instead of handing it to another pool thread.
Polling holds the GIL between reads, so it is skipped for peers in this process and
while other threads of the process run RPC functions. Where this machine has a core for
each of the job's RPC processes on it, waits poll for up to ``busy_poll_max_us``
(``_pollgate``: twice their kind's average wait).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jdist._cores import usable_cores
from jdist.errors import (
    RpcError,
    WorkerUnavailableError,
)
from jdist.rpc import _protocol as P
from jdist.rpc import _serialize as S
from jdist.rpc._auth import HANDSHAKE_MAX_BYTES
from jdist.rpc._client import LOCAL_ADDRESSES, CallClient, Pending
from jdist.rpc._connections import Connections
from jdist.rpc._futures import Future
from jdist.rpc._notes import Notes
from jdist.rpc._options import RpcBackendOptions
from jdist.rpc._pollgate import NEXT_SLEEP_S, WINDOWS, PollGate
from jdist.rpc._protocol import WorkerInfo
from jdist.rpc._releaser import Releaser
from jdist.rpc._remote_error import failure_payload
from jdist.rpc._rref import RRef, RRefContext
from jdist.rpc._serve import CallServer, quiet
from jdist.rpc._workers import WorkerTable
from jdist.rpc.transport import Comm, get_transport, parse_address

__all__ = ["RpcAgent"]

log = logging.getLogger("jdist.rpc")


def co_located(address: str, addresses: list[str]) -> int:
    """How many of ``addresses`` are at ``address``'s host (``scheme://HOST:PORT...``;
    an address without a port is its own host)."""
    def host(a: str) -> str:
        scheme, loc = parse_address(a)
        loc = loc.partition("#")[0]
        return f"{scheme}://{loc.rpartition(':')[0] or loc}"

    mine = host(address)
    return sum(host(a) == mine for a in addresses)


class RpcAgent(CallClient, CallServer):
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
        self._workers = WorkerTable(self.info, world_size)
        self._conns = Connections(self._workers, auth_key, options, self._transport,
                                  run=self._run, dispatch=self._dispatch,
                                  mark_dead=self._mark_dead, refusal=self._refusal)
        self._dead: dict[int, str] = {}
        self._pending: dict[int, Pending] = {}
        self._ctl_pending: set[Future] = set()
        #: request id -> forks of user RRefs it sent to their owner, kept until its reply
        self._reply_holds: dict[int, list] = {}
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
        self._init_waits(options)
        self.quiet_leaves = False  # set by graceful shutdown once every worker is done
        self.rrefs = RRefContext(self)
        self._releaser = Releaser(
            name, self.rrefs.handle_released,
            lambda owner, rref_id, fork: self.control_note(
                owner, P.ControlOp.USER_DELETE, rref_id, fork),
            lambda: self.state == "running")
        self.released = self._releaser.queue  # RRef.__del__ puts its release here
        #: released contexts and control notes not yet told to their workers
        self.notes = Notes()
        self._init_hooks()

    def _init_waits(self, options: RpcBackendOptions) -> None:
        """What the busy-poll and sleep decisions learn from."""
        self._poll_s = options.busy_poll_us * 1e-6
        #: which waits busy-poll, learned from how long such waits lasted
        self.poll_gate = PollGate(self._poll_s)
        #: peer -> (kind, start) of a pool thread's wait for that peer's next call
        self._next_call_waits: dict[int, tuple] = {}
        #: peer -> its rpc_* calls running here now (counted by _run_one; remote()
        #: values are not): a pool thread sleeps for a peer's next call only at zero
        self._running_from: dict[int, int] = {}
        #: the same waits, for sleeping on the connection: allowed while their kind's
        #: average is at most NEXT_SLEEP_S
        self.sleep_gate = PollGate(NEXT_SLEEP_S / WINDOWS)

    def _init_hooks(self) -> None:
        """Distributed autograd's hooks (installed by ``start_agent``)."""
        #: context id to send, and a context manager factory entered around incoming
        #: calls with their context id
        self.context_id_hook: Callable[[int], int] | None = None
        self.enter_context_hook: Callable[[int], Any] | None = None
        #: asked first by rpc_async: a Future for a differentiable call, or None
        self.call_hook: Callable[..., Future | None] | None = None
        self.remote_hook: Callable[..., RRef | None] | None = None  # the same for remote()
        #: called with the context ids a peer's call says it released
        self.release_contexts_hook: Callable[[tuple], None] | None = None

    def __repr__(self) -> str:
        return f"RpcAgent({self.info}, {self.state}, address={self.address})"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> str:
        """Start the I/O thread and the listener; return the listening address."""
        self._thread.start()
        self._releaser.start()
        self.address = self._run(self._start(), 30.0)
        LOCAL_ADDRESSES.add(self.address)
        self.state = "running"
        return self.address

    async def _start(self) -> str:
        self._listener = await self._transport.listen(
            self.options.listen_on(), self._conns.serve, max_message_bytes=HANDSHAKE_MAX_BYTES)
        self._timer_task = self._loop.create_task(self._expire_timers())
        return self._listener.address

    def set_workers(self, table: dict[int, tuple[str, str]]) -> None:
        """Install the rendezvous result: rank -> (name, address)."""
        self._workers.install(table)
        if self.address is not None and \
                co_located(self.address, [a for _, a in table.values()]) <= usable_cores():
            self.poll_gate.widen(self.options.busy_poll_max_us * 1e-6)
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
        """Resolve a worker name, rank or WorkerInfo (None: this worker); see
        :meth:`jdist.rpc._workers.WorkerTable.resolve` for the errors."""
        return self._workers.resolve(to)

    def all_workers(self) -> list[WorkerInfo]:
        return self._workers.all()

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
    def _refusal(self, rank: int) -> Exception | None:
        """Why no new connection to ``rank`` may be made now (None: it may)."""
        if rank in self._dead:
            return WorkerUnavailableError(
                f"worker {self._workers[rank]} is unavailable: {self._dead[rank]}")
        if self.state != "running":
            return RpcError(f"RPC agent {self.info} is {self.state}; no new calls")
        return None

    def _conn_to(self, rank: int) -> Comm:
        return self._conns.to(rank)

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

    # ------------------------------------------------------------------ shutdown
    def pending_count(self) -> int:
        with self._lock:
            return len(self._pending)

    def drain(self, deadline: float,
              on_wait: Callable[[list[int]], bool] | None = None) -> bool:
        """Wait until no request or control message of ours is pending (True) or time is up.

        ``on_wait(ranks)`` runs about every 0.5 s with the workers our pending requests
        wait for; a true result stops the wait (False is returned).
        """
        next_check = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            self.send_all_notes()
            with self._lock:
                busy = (bool(self._pending) or self._releaser.busy()
                        or self.notes.any())
                waiting = sorted({p.worker.id for p in self._pending.values()})
            if not busy:
                return True
            if on_wait is not None and time.monotonic() >= next_check:
                next_check = time.monotonic() + 0.5
                if on_wait([r for r in waiting if r != self.info.id]):
                    return False
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
        self._releaser.stop()
        LOCAL_ADDRESSES.discard(self.address)
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
        for comm in self._conns.all():
            comm.close()
        await asyncio.sleep(0.01)
