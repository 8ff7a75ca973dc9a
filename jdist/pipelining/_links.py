"""Activations and gradients between the processes of a pipeline.

Each message goes from the rank that made it to the rank of the stage that needs it,
through jdist's point-to-point ``send``/``recv`` (XLA collectives between the pair): a
small header (kind, dtype, shape), then the array. Both sides know every message in
advance: the receiver reads its peers' action lists (the schedule's order is the same
pure function on every rank), so messages on each (sender, receiver) pair go in the
sender's action order, which is the order the receiver reads them in. One thread per
peer sends and one receives, so computing never waits on a send and two ranks that
send to each other at once cannot deadlock.

A rank whose stage raises sends an error header, with its message, on every link; the
receiving rank raises :class:`~jdist.errors.PeerFailedError` naming it and passes the
error on, so every rank of the pipeline raises instead of waiting.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import numpy as np

from jdist.errors import CollectiveTimeoutError, PeerFailedError
from jdist.pipelining._agree import OK, Liveness, group_store, hear_all, say

__all__ = ["Links", "dtype_named"]

HEADER = 12  # int32: kind, dtype code, ndim, then up to 9 dims
DATA, ERROR = 1, 2
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "bool", "int8",
          "uint8")


def dtype_named(name: str):
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _header(kind: int, x: np.ndarray | None = None) -> np.ndarray:
    h = np.zeros(HEADER, np.int32)
    h[0] = kind
    if x is not None:
        if x.dtype.name not in DTYPES or x.ndim > HEADER - 3:
            raise ValueError(f"a pipeline stage passed an array of dtype {x.dtype} and "
                             f"{x.ndim} dims; stages exchange arrays of {DTYPES} with at "
                             f"most {HEADER - 3} dims")
        h[1], h[2] = DTYPES.index(x.dtype.name), x.ndim
        h[3:3 + x.ndim] = x.shape
    return h


class Links:
    """This rank's links for one step: ``put`` sends, ``get`` waits for a message.

    Args:
      jd: the ``jdist`` collectives module (send/recv).
      group: the pipeline's process group (ranks are its group ranks).
      sends: peer -> number of messages this rank sends it this step.
      recvs: peer -> the keys of the messages it sends this rank, in order.
      timeout: seconds ``get`` waits.
      tag: ``"<group>/<schedule>/<step>"``, the same on every rank (the end-of-step
        agreement's store keys, ``jdist/pipelining/_agree.py``).
    """

    def __init__(self, jd, group, sends: dict[int, int], recvs: dict[int, list],
                 timeout: float, tag: str) -> None:
        self.jd, self.group, self.timeout, self.tag = jd, group, timeout, tag
        self.got: dict[Any, np.ndarray] = {}
        self.error: str | None = None
        self.cond = threading.Condition()
        self.outbox = {p: queue.Queue() for p in sends}
        self.threads = [threading.Thread(target=self._send_loop, args=(p, n), daemon=True,
                                         name=f"jdist-pipe-send-{p}")
                        for p, n in sends.items() if n]
        self.threads += [threading.Thread(target=self._recv_loop, args=(p, keys),
                                          daemon=True, name=f"jdist-pipe-recv-{p}")
                         for p, keys in recvs.items() if keys]
        for t in self.threads:
            t.start()

    def _global(self, peer: int) -> int:
        return self.group.ranks[peer] if hasattr(self.group, "ranks") else peer

    def put(self, peer: int, x) -> None:
        """Queue array ``x`` for ``peer`` (the next message of this rank's plan)."""
        self.outbox[peer].put(np.ascontiguousarray(np.asarray(x)))

    def fail(self, message: str) -> None:
        """Send an error header with ``message`` on every link (after what is queued),
        and say in the store that this rank's step failed."""
        for q in self.outbox.values():
            q.put(message)
        try:
            say(group_store(), self.tag, self._global(self.group.rank), message.encode())
        except Exception:  # noqa: BLE001 (the links carry the error too)
            pass

    def finish(self) -> None:
        """Say this rank's step succeeded and wait until every rank said how its step
        ended (PeerFailedError naming one that failed)."""
        store, me = group_store(), self._global(self.group.rank)
        say(store, self.tag, me, OK)
        hear_all(store, self.tag, [self._global(p) for p in range(self.group.size())],
                 me, self.timeout)

    def _send_loop(self, peer: int, n: int) -> None:
        dst = self._global(peer)
        try:
            for _ in range(n):
                item = self.outbox[peer].get()
                if isinstance(item, str):
                    data = np.frombuffer(item.encode()[:4000], np.uint8).copy()
                    self.jd.send(_header(ERROR, data), dst=dst)
                    self.jd.send(data, dst=dst)
                    return
                self.jd.send(_header(DATA, item), dst=dst)
                self.jd.send(item, dst=dst)
        except Exception as exc:  # the peer is gone: its own error says why
            self._set_error(f"sending to rank {dst} failed: {exc}")

    def _recv_loop(self, peer: int, keys: list) -> None:
        src = self._global(peer)
        try:
            for key in keys:
                _, h = self.jd.recv(np.zeros(HEADER, np.int32), src=src)
                kind, code, ndim = int(h[0]), int(h[1]), int(h[2])
                shape = tuple(int(d) for d in h[3:3 + ndim])
                _, x = self.jd.recv(np.empty(shape, dtype_named(DTYPES[code])), src=src)
                if kind == ERROR:
                    self._set_error(f"rank {src}: {bytes(np.asarray(x)).decode(errors='replace')}")
                    return
                with self.cond:
                    self.got[key] = x
                    self.cond.notify_all()
        except Exception as exc:
            self._set_error(f"receiving from rank {src} failed: {exc}")

    def _set_error(self, message: str) -> None:
        with self.cond:
            if self.error is None:
                self.error = message
            self.cond.notify_all()

    def get(self, key, what: str, peer: int) -> np.ndarray:
        """The array of message ``key`` (waits up to the timeout; a sender whose process
        is gone is noticed within a second or two, while XLA's receive still waits)."""
        deadline, liveness = time.monotonic() + self.timeout, Liveness()
        with self.cond:
            while key not in self.got:
                if self.error is not None:
                    raise PeerFailedError(f"pipeline: {what} never came: {self.error}")
                why = liveness.gone(self._global(peer))
                if why is not None:
                    raise PeerFailedError(f"pipeline: {what} never came: rank "
                                          f"{self._global(peer)} is gone ({why})")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeoutError(
                        f"pipeline: {what} did not arrive from rank {self._global(peer)} "
                        f"within {self.timeout:g} s; check that every rank runs the same "
                        f"schedule (stages, micro-batches) and calls step()")
                self.cond.wait(min(left, 0.5))
            return self.got.pop(key)

    def close(self, wait: float) -> None:
        """Wait (at most ``wait`` s) for the queued sends to go out."""
        end = time.monotonic() + wait
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))
