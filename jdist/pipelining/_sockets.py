"""Activations and gradients between the pipeline's processes over jdist's authenticated
mailbox (``jdist/_mailbox.py``), and the choice between it and XLA's point-to-point.

Departure from DESIGN.md ("bytes between devices move through XLA"), as the issue that
asked for pipelining allows ("XLA collectives or jdist's p2p, whichever is faster,
measured"): on CPU, one XLA point-to-point array costs a compiled program on each side
(a header and an array: about 2 ms a message here), while one socket message costs
about 0.1 ms (``benchmarks/pipelining.py`` times both transports in the same run). So
``transport="auto"`` takes the mailbox when every rank of the pipeline group runs on
this host and JAX's backend is the CPU, and XLA otherwise (GPU arrays stay on devices;
a mailbox listens on loopback only).

The mailbox is one per process and store (every schedule shares it); its address and
host name are published in the process group's store. The secret is
``$JDIST_AUTH_TOKEN`` (``jdist-run`` sets one per job), else a random one agreed in the
store (then the mailbox is as safe as that store, as jdist.rpc without a token).

Messages of one step are keyed ``"<schedule>/<step>/<n>"``: the n-th message this rank
sends that peer in this step (both sides know every message in advance, as in
``jdist/pipelining/_links.py``); an error is ``"<schedule>/<step>/err"``, which a
waiting receiver polls, so a stage that raises makes every rank raise.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import numpy as np

from jdist._mailbox import Mailbox
from jdist.errors import CollectiveTimeoutError, PeerFailedError, StoreTimeoutError
from jdist.pipelining._links import dtype_named, peer_gone

__all__ = ["TRANSPORTS", "SocketLinks", "choose_transport", "next_schedule_id", "wire_for"]

TRANSPORTS = ("auto", "socket", "xla")
_lock = threading.Lock()
_wire: dict[str, Any] = {}  # "store": the store, "box": this process's mailbox, "peers"
_counters: dict[tuple, int] = {}  # pipeline group's ranks -> schedules made on them


class _PipeMailbox(Mailbox):
    word = "pipeline rank"


def _store():
    from jdist.collectives.runtime import group_state

    runtime = group_state.runtime
    store = runtime.get("store") if runtime else None
    if store is None:
        raise ValueError("pipelining across processes needs jdist.init_process_group() "
                         "in every process (its store carries the peers' addresses)")
    return store


def _secret(store) -> bytes:
    token = os.environ.get("JDIST_AUTH_TOKEN")
    if token:
        return token.encode()
    mine = secrets.token_hex(32).encode()
    return bytes(store.compare_set("jdist/pipe/secret", "", mine))


def wire_for(group) -> tuple[Mailbox, dict[int, dict]]:
    """This process's mailbox and ``{group rank: {"addr", "host"}}`` of the group's
    processes (published once per store; a new store replaces the mailbox)."""
    store = _store()
    with _lock:
        if _wire.get("store") is not store:
            if _wire.get("box") is not None:
                _wire["box"].close()
            me = group.ranks[group.rank]
            box = _PipeMailbox(me, 0, _secret(store))
            store.set(f"jdist/pipe/addr/{me}",
                      json.dumps({"addr": box.address, "host": socket.gethostname()}))
            _wire.update(store=store, box=box, peers={})
        box, peers = _wire["box"], _wire["peers"]
        for g in group.ranks:
            if g not in peers:
                peers[g] = json.loads(_published(store, f"jdist/pipe/addr/{g}", g,
                                                 group.timeout))
        return box, {r: peers[g] for r, g in enumerate(group.ranks)}


def _published(store, key: str, rank: int, timeout: float) -> bytes:
    """``store.get(key)`` once rank ``rank`` set it, looking every second whether that
    rank's process is gone (then PeerFailedError, not a wait until ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            store.wait([key], timedelta(seconds=min(1.0, max(0.01, deadline - time.monotonic()))))
            return store.get(key)
        except StoreTimeoutError:
            why = peer_gone(rank)
            if why is not None:
                raise PeerFailedError(f"pipeline: rank {rank} is gone ({why}) before it "
                                      f"published its address") from None
            if time.monotonic() >= deadline:
                raise CollectiveTimeoutError(
                    f"pipeline: rank {rank} did not publish its address within {timeout:g} "
                    f"s; build the schedule and call step() on every rank of the "
                    f"pipeline group") from None


def choose_transport(transport: str, group) -> str:
    """``"socket"`` or ``"xla"`` for a pipeline over ``group`` (see the module text)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r}; choose one of {TRANSPORTS}")
    if transport == "xla":
        return "xla"
    _, peers = wire_for(group)
    hosts = sorted({p["host"] for p in peers.values()})
    if len(hosts) > 1:
        if transport == "socket":
            raise ValueError(f"transport='socket' listens on loopback, but the pipeline's "
                             f"ranks run on several hosts {hosts}; use transport='xla' "
                             f"(or 'auto')")
        return "xla"
    if transport == "auto":
        import jax

        return "socket" if jax.default_backend() == "cpu" else "xla"
    return "socket"


def next_schedule_id(group) -> int:
    """A number for a new schedule on ``group``, the same on every rank of it (schedules
    on one group are made in the same order everywhere, as collectives are called)."""
    with _lock:
        key = tuple(group.ranks)
        _counters[key] = _counters.get(key, 0) + 1
        return _counters[key]


class SocketLinks:
    """:class:`~jdist.pipelining._links.Links`'s interface over the mailbox, for one step.

    Args:
      group: the pipeline's process group.
      tag: ``"<schedule>/<step>"``, the same on every rank for this step.
      sends: peer -> number of messages this rank sends it this step.
      recvs: peer -> the keys of the messages it sends this rank, in order.
      timeout: seconds ``get`` waits.
    """

    def __init__(self, group, tag: str, sends: dict[int, int], recvs: dict[int, list],
                 timeout: float) -> None:
        self.box, self.peers = wire_for(group)
        self.ranks, self.tag, self.timeout = group.ranks, tag, timeout
        self.sent = {p: 0 for p in sends}
        self.index = {p: {key: n for n, key in enumerate(keys)} for p, keys in recvs.items()}
        self.others = [p for p in self.peers if p != group.rank]
        self._looked = time.monotonic()  # (the first liveness look after a second)

    def _post(self, peer: int, key: str, frames: list) -> None:
        self.box.post(self.ranks[peer], self.peers[peer]["addr"], f"{self.tag}/{key}",
                      frames, self.timeout)

    def put(self, peer: int, x) -> None:
        """Send array ``x`` to ``peer`` (the next message of this rank's plan)."""
        x = np.ascontiguousarray(np.asarray(x))
        head = json.dumps({"dtype": x.dtype.name, "shape": list(x.shape)}).encode()
        n, self.sent[peer] = self.sent[peer], self.sent[peer] + 1
        self._post(peer, str(n), [head, x])

    def fail(self, message: str) -> None:
        """Tell every peer of the group that this rank failed, with ``message``."""
        for p in self.others:
            self._post(p, "err", [message.encode()[:4000]])

    def _dead(self, src: int) -> str | None:
        """Why rank ``src``'s process is gone, looked up at most once a second."""
        now = time.monotonic()
        if now - self._looked < 1.0:
            return None
        self._looked = now
        return peer_gone(src)

    def _check(self, src: int) -> None:
        why = self._dead(src)
        if why is not None:
            raise PeerFailedError(f"rank {src} is gone ({why})")
        for p in self.others:
            frames = self.box.poll(f"{self.tag}/err", self.ranks[p])
            if frames is not None:
                raise PeerFailedError(f"rank {self.ranks[p]}: "
                                      f"{bytes(frames[0]).decode(errors='replace')}")
        why = self.box.failure(f"{self.tag}/")
        if why is not None:
            raise PeerFailedError(why)

    def get(self, key, what: str, peer: int) -> np.ndarray:
        """The array of message ``key`` from ``peer`` (waits up to the timeout)."""
        src = self.ranks[peer]
        try:
            head, data = self.box.take(f"{self.tag}/{self.index[peer][key]}", (src, 0),
                                       time.monotonic() + self.timeout,
                                       lambda: self._check(src), what)
        except CollectiveTimeoutError:
            raise CollectiveTimeoutError(
                f"pipeline: {what} did not arrive from rank {src} within {self.timeout:g} "
                f"s; check that every rank runs the same schedule (stages, micro-batches) "
                f"and calls step()") from None
        except PeerFailedError as exc:
            raise PeerFailedError(f"pipeline: {what} never came: {exc}") from None
        meta = json.loads(bytes(head))
        return np.frombuffer(data, dtype_named(meta["dtype"])).reshape(meta["shape"])

    def close(self, wait: float) -> None:
        """Wait (at most ``wait`` s) for this rank's messages to be written, and drop
        what is left of this step in the inbox (after a failure)."""
        self.box.flush(time.monotonic() + wait)
        prefix = f"{self.tag}/"
        self.box.forget(lambda key: not key.startswith(prefix))
