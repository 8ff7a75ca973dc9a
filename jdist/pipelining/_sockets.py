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
host (host name, boot id and network namespace: loopback is per namespace) are
published in the process group's store. Its secret is ``$JDIST_AUTH_TOKEN`` (``jdist-run``
and ``spawn`` set one per job); without one, ``"auto"`` takes XLA and ``"socket"``
raises (a secret agreed through the store would be as readable as the store).

Messages of one step are keyed ``"<group>/<schedule>/<step>/<n>"``: the n-th message
this rank sends that peer in this step (both sides know every message in advance, as
in ``jdist/pipelining/_links.py``); schedules are numbered per group as they are built.
An error is ``".../err"``, which a waiting receiver polls, and the end of a successful
step ``".../done"`` to every peer, which every rank waits for before it returns
(``jdist/pipelining/_agree.py``: a failure anywhere raises everywhere). A step's
leftovers (after a failure) are dropped when the schedule's next step starts.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any

import numpy as np

from jdist._mailbox import Mailbox
from jdist.errors import CollectiveTimeoutError, PeerFailedError
from jdist.pipelining._agree import OK, Liveness, group_store, published
from jdist.pipelining._links import dtype_named

__all__ = ["TRANSPORTS", "SocketLinks", "choose_transport", "next_schedule_id", "wire_for"]

TRANSPORTS = ("auto", "socket", "xla")
_lock = threading.Lock()
_wire: dict[str, Any] = {}  # "store": the store, "box": this process's mailbox, "peers"
_counters: dict[tuple, int] = {}  # (group name, ranks) -> schedules built on it


class _PipeMailbox(Mailbox):
    word = "pipeline rank"


def _secret() -> bytes:
    return (os.environ.get("JDIST_AUTH_TOKEN") or "").encode()


def _host() -> str:
    """This machine and network namespace (loopback is per namespace): containers of
    several nodes may share a host name, not a boot id and a namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        net = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        boot, net = "", 0
    return f"{socket.gethostname()}/{boot}/{net}"


def wire_for(group) -> tuple[Mailbox, dict[int, dict]]:
    """This process's mailbox and ``{group rank: {"addr", "host"}}`` of the group's
    processes (published once per store; a new store replaces the mailbox)."""
    store = group_store()
    with _lock:
        if _wire.get("store") is not store:
            if _wire.get("box") is not None:
                _wire["box"].close()
            me = group.ranks[group.rank]
            secret = _secret()
            box = _PipeMailbox(me, 0, secret) if secret else None
            store.set(f"jdist/pipe/addr/{me}", json.dumps(
                {"addr": None if box is None else box.address, "host": _host()}))
            _wire.update(store=store, box=box, peers={})
        box, peers = _wire["box"], _wire["peers"]
        for g in group.ranks:
            if g not in peers:
                peers[g] = json.loads(published(store, f"jdist/pipe/addr/{g}", g,
                                                group.timeout, "publishing its address"))
        return box, {r: peers[g] for r, g in enumerate(group.ranks)}


def choose_transport(transport: str, group) -> str:
    """``"socket"`` or ``"xla"`` for a pipeline over ``group`` (see the module text)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r}; choose one of {TRANSPORTS}")
    if transport == "xla":
        return "xla"
    _, peers = wire_for(group)
    hosts = sorted({p["host"] for p in peers.values()})
    if len(hosts) > 1 or any(p["addr"] is None for p in peers.values()):
        if transport == "socket":
            raise ValueError(f"transport='socket' needs every rank of the pipeline on one "
                             f"host (its mailbox listens on loopback) and the job's secret "
                             f"in JDIST_AUTH_TOKEN (jdist-run and spawn set one); got hosts "
                             f"{hosts} and a secret on ranks "
                             f"{[r for r, p in peers.items() if p['addr'] is not None]}; "
                             f"use transport='xla' (or 'auto')")
        return "xla"
    if transport == "auto":
        import jax

        return "socket" if jax.default_backend() == "cpu" else "xla"
    return "socket"


def next_schedule_id(group) -> int:
    """A number for a new schedule on ``group``, the same on every rank of it (schedules
    on one group are built in the same order everywhere, as collectives are called)."""
    with _lock:
        key = (group.name, tuple(group.ranks))
        _counters[key] = _counters.get(key, 0) + 1
        return _counters[key]


class SocketLinks:
    """:class:`~jdist.pipelining._links.Links`'s interface over the mailbox, for one step.

    Args:
      group: the pipeline's process group.
      tag: ``"<group>/<schedule>/<step>"``, the same on every rank for this step.
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
        self._liveness = Liveness()
        head, _, step = tag.rpartition("/")
        self.box.forget(lambda key: not _before(key, f"{head}/", int(step)))

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

    def _check(self, src: int) -> None:
        why = self._liveness.gone(src)
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
        head, data = self._take(str(self.index[peer][key]), peer, what)
        meta = json.loads(bytes(head))
        return np.frombuffer(data, dtype_named(meta["dtype"])).reshape(meta["shape"])

    def _take(self, key: str, peer: int, what: str) -> list:
        src = self.ranks[peer]
        try:
            return self.box.take(f"{self.tag}/{key}", (src, 0),
                                 time.monotonic() + self.timeout, lambda: self._check(src),
                                 what)
        except CollectiveTimeoutError:
            raise CollectiveTimeoutError(
                f"pipeline: {what} did not arrive from rank {src} within {self.timeout:g} "
                f"s; check that every rank runs the same schedule (stages, micro-batches) "
                f"and calls step()") from None
        except PeerFailedError as exc:
            raise PeerFailedError(f"pipeline: {what} never came: {exc}") from None

    def finish(self) -> None:
        """Tell every peer this rank's step succeeded and wait for each peer's word: a
        peer whose step failed sent its error instead (PeerFailedError naming it)."""
        for p in self.others:
            self._post(p, "done", [OK])
        for p in self.others:
            self._take("done", p, "the end of the step")

    def close(self, wait: float) -> None:
        """Wait (at most ``wait`` s) for this rank's messages to be written, and drop
        what is left of this step in the inbox (after a failure)."""
        self.box.flush(time.monotonic() + wait)
        prefix = f"{self.tag}/"
        self.box.forget(lambda key: not key.startswith(prefix))


def _before(key: str, prefix: str, step: int) -> bool:
    """Whether ``key`` is a message of this schedule (``prefix``) from a step before
    ``step`` (left over after a failure)."""
    if not key.startswith(prefix):
        return False
    head = key[len(prefix):].split("/", 1)[0]
    return head.isdigit() and int(head) < step
