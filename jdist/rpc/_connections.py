"""The agent's connections: one outgoing connection per peer, made on first use and
authenticated, and the incoming ones the listener accepted.

One job, one lock per peer (connecting). The agent hands in what a connection needs of
it as callables: ``run`` (a coroutine on the I/O loop, with a timeout), ``dispatch``
(one incoming message), ``mark_dead`` (a connection failed or dropped) and
``refusal`` (why no new connection may be made now, or None).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from jdist.errors import RpcAuthError, WorkerUnavailableError
from jdist.rpc._auth import HANDSHAKE_MAX_BYTES, client_handshake, server_handshake
from jdist.rpc._gate import HandshakeGate
from jdist.rpc._workers import WorkerTable
from jdist.rpc.transport import Comm

__all__ = ["Connections"]

log = logging.getLogger("jdist.rpc")
_HANDSHAKE_TIMEOUT = 10.0


class Connections:
    """Outgoing and incoming connections of one agent."""

    def __init__(self, workers: WorkerTable, key: bytes, options: Any, transport: Any, *,
                 run: Callable, dispatch: Callable, mark_dead: Callable,
                 refusal: Callable[[int], Exception | None]):
        self.workers, self.key, self.options, self.transport = workers, key, options, transport
        self.run, self.dispatch, self.mark_dead, self.refusal = run, dispatch, mark_dead, refusal
        self.outgoing: dict[int, Comm] = {}
        self.incoming: set[Comm] = set()
        self.gate = HandshakeGate(str(workers.me), log)
        self._locks: dict[int, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    def get(self, rank: int) -> Comm | None:
        """The open outgoing connection to ``rank``, if any (never connects)."""
        comm = self.outgoing.get(rank)
        return comm if comm is not None and not comm.closed else None

    def all(self) -> list[Comm]:
        return list(self.outgoing.values()) + list(self.incoming)

    def _lock(self, rank: int) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(rank, threading.Lock())

    def to(self, rank: int) -> Comm:
        """The connection to ``rank``, made now if needed.

        Raises:
          WorkerUnavailableError: it cannot be reached (it is marked dead).
          RpcAuthError: it answered with another secret.
        """
        comm = self.get(rank)
        if comm is not None:
            return comm
        with self._lock(rank):
            comm = self.get(rank)
            if comm is not None:
                return comm
            refused = self.refusal(rank)
            if refused is not None:
                raise refused
            address = self.workers.addresses[rank]
            try:
                comm = self.run(self._connect(rank), self.options.connect_timeout + 5)
            except RpcAuthError:
                raise
            except Exception as e:
                self.mark_dead(rank, f"cannot connect to {address}: {e}")
                raise WorkerUnavailableError(
                    f"worker {self.workers[rank]} is unavailable: cannot connect to "
                    f"{address} ({e})") from e
            self.outgoing[rank] = comm
            return comm

    async def _connect(self, rank: int) -> Comm:
        address = self.workers.addresses[rank]
        comm = await self.transport.connect(address, timeout=self.options.connect_timeout,
                                            max_message_bytes=HANDSHAKE_MAX_BYTES)
        try:
            await asyncio.wait_for(client_handshake(comm, self.key, self.workers.me.id,
                                                    address), self.options.connect_timeout)
        except BaseException:
            comm.close()
            raise
        comm.set_max_message_bytes(self.options.max_frame_bytes)
        self._start_reading(comm, rank)
        return comm

    async def serve(self, comm: Comm) -> None:
        """The listener's callback: authenticate a new connection, then read it."""
        self.gate.admit(comm)  # over the limit it closes the oldest one authenticating
        try:
            peer = await asyncio.wait_for(
                server_handshake(comm, self.key, self.options.max_frame_bytes),
                _HANDSHAKE_TIMEOUT)
        except Exception as e:  # wrong secret, garbage, timeout: drop, keep serving
            self.gate.refused(str(e) or type(e).__name__)
            comm.close()
            return
        finally:
            self.gate.release(comm)
        if peer not in self.workers and self.workers:
            self.gate.refused(f"it claims unknown rank {peer}")
            comm.close()
            return
        comm.set_max_message_bytes(self.options.max_frame_bytes)
        self.incoming.add(comm)
        self._start_reading(comm, peer)

    def _start_reading(self, comm: Comm, peer: int) -> None:
        """Dispatch each message from ``peer`` on the I/O thread; a drop marks it dead."""
        me = self.workers.me

        def on_message(frames: list) -> None:
            try:
                self.dispatch(comm, peer, frames)
            except Exception:
                log.exception("jdist.rpc: %s failed to handle a message", me)

        def on_close(reason: str) -> None:
            comm.close()
            self.incoming.discard(comm)
            if peer != me.id:
                self.mark_dead(peer, reason)

        comm.start_receiving(on_message, on_close)
