"""Point-to-point: ``send``/``recv``/``isend``/``irecv`` between two processes.

A message from ``src`` to ``dst`` is one cached program over the two-device mesh
``[first device of src, first device of dst]`` doing a ``ppermute`` (through XLA's
collectives, like everything else); only those two processes take part. Before the
program the pair compares fingerprints (shape, dtype, tag, per-channel sequence
number), so a mismatched pair raises ``CollectiveMismatchError`` on both.

``recv(src=None)`` (any source) needs to learn who sends: every ``send`` also posts a
small announcement ``(src, message index, tag)`` in the store, which the receiver reads
in order, skipping messages it already received by naming their source.

Each channel (direction, peer) has its own FIFO thread, so ``isend`` and ``irecv`` to
different peers overlap and a ring of them cannot deadlock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from jdist.collectives import _engine as eng
from jdist.collectives import _fingerprint as fpr
from jdist.collectives._eager import _prep, _write_back, queues
from jdist.collectives._group import ProcessGroup, group_state, make_mesh
from jdist.collectives._inplace import check_kept
from jdist.collectives._result import as_result
from jdist.errors import CollectiveTimeoutError, GroupMismatchError, NotInitializedError

__all__ = ["send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv"]


def _world(what: str) -> ProcessGroup:
    if not group_state.is_initialized():
        raise NotInitializedError(
            f"Default process group has not been initialized, please make sure to call "
            f"init_process_group. (jdist.{what} needs it; call jdist.init_process_group() "
            f"first, in every process)"
        )
    return group_state.default_group


def _peer(world: ProcessGroup, group, peer, group_peer, name: str, what: str) -> int:
    if group is not None and group is not world:
        if group_peer is not None:
            if not 0 <= group_peer < group.size():
                raise GroupMismatchError(f"jdist.{what}: group_{name}={group_peer!r} is not a rank "
                                 f"of group {group.name!r} (0..{group.size() - 1})")
            peer = group.ranks[group_peer]
        elif peer not in group.ranks:
            raise GroupMismatchError(f"jdist.{what}: {name}={peer!r} is not a member of group "
                             f"{group.name!r} (members {list(group.ranks)})")
    elif group_peer is not None:
        peer = group_peer
    if not isinstance(peer, (int, np.integer)) or not 0 <= peer < world.size():
        raise ValueError(f"jdist.{what}: {name}={peer!r} is not a rank in [0, "
                         f"{world.size() - 1}]")
    if peer == world.rank:
        raise ValueError(f"jdist.{what}: {name}={peer} is this process's own rank; "
                         f"send/recv need two different processes")
    return int(peer)


def _pair(world: ProcessGroup, src: int, dst: int) -> ProcessGroup:
    """A two-member group ``(src, dst)`` used as the program's mesh holder (cached)."""
    pairs = world.extra.setdefault("pairs", {})
    key = (src, dst)
    g = pairs.get(key)
    if g is None:
        devs = (world.devices_per_rank[src][:1], world.devices_per_rank[dst][:1])
        g = ProcessGroup(ranks=(src, dst), rank=0 if world.rank == src else 1,
                         mesh=make_mesh([devs[0][0], devs[1][0]], "p2p"), axis_name="p2p",
                         backend=world.backend, devices_per_rank=devs,
                         name=f"p2p({src}->{dst})", timeout=world.timeout)
        pairs[key] = g
    return g


def _transfer(world: ProcessGroup, src: int, dst: int, x, shape, dtype, tag: int,
              as_jax: bool):
    g = _pair(world, src, dst)
    fp = fpr.encode(eng.next_seq(g), "send/recv", None, shape, dtype, root=src,
                    count=int(tag))

    def build():
        return lambda v: jax.lax.ppermute(v, "p2p", [(0, 1)])

    return eng.run(g, f"send/recv {src}->{dst}", ("p2p",), build, x, shape, dtype, fp,
                   as_jax)


def _announce(world: ProcessGroup, dst: int, tag: int) -> None:
    wd = group_state.runtime.get("watchdog")
    store = wd.store if wd is not None else None
    if store is None:
        return
    counts = world.extra.setdefault("sent", {})
    index = counts.get(dst, 0)
    counts[dst] = index + 1
    prefix = f"jdist/p2p/{group_state.generation}/{dst}/"
    with wd.lock:
        slot = store.add(prefix + "n", 1)
        store.set(prefix + str(slot), f"{world.rank},{index},{tag}")


def _any_source(world: ProcessGroup, tag: int, timeout: float) -> int:
    """The source of the oldest message to this rank not yet received."""
    wd = group_state.runtime.get("watchdog")
    store = wd.store if wd is not None else None
    if store is None:
        raise RuntimeError("jdist.recv(src=None) needs a store (multi-process job)")
    state = world.extra.setdefault("any", {"next": 1, "pending": []})
    received = world.extra.setdefault("received", {})
    prefix = f"jdist/p2p/{group_state.generation}/{world.rank}/"
    deadline = time.monotonic() + timeout
    sleep = 0.0005
    while True:
        # announcements seen earlier with another tag, oldest first
        state["pending"] = [a for a in state["pending"] if a[1] >= received.get(a[0], 0)]
        for src, _index, msg_tag in state["pending"]:
            if msg_tag == tag:
                return src
        key = prefix + str(state["next"])
        with wd.lock:
            found = store.check([key])
            value = store.get(key).decode() if found else None
        if value is not None:
            state["next"] += 1
            src, index, msg_tag = (int(v) for v in value.split(","))
            if index >= received.get(src, 0):
                if msg_tag == tag:
                    return src
                state["pending"].append((src, index, msg_tag))
            continue
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(
                f"jdist.recv(src=None) on rank {world.rank}: no message arrived within "
                f"{timeout:g} s"
            )
        time.sleep(sleep)
        sleep = min(sleep * 2, 0.05)


def _do_send(world, tensor, dst, tag):
    x, as_jax = _prep(tensor, "send")
    _announce(world, dst, tag)
    _transfer(world, world.rank, dst, x, tuple(x.shape), x.dtype, tag, as_jax)


def _do_recv(world, tensor, src, tag):
    x, as_jax = _prep(tensor, "recv")
    if src is None:
        src = _any_source(world, tag, world.timeout)
    out = as_result(_transfer(world, src, world.rank, x, tuple(x.shape), x.dtype, tag,
                              as_jax), tensor, as_jax, tuple(x.shape))
    received = world.extra.setdefault("received", {})
    received[src] = received.get(src, 0) + 1
    _write_back(tensor, out)
    return src, out


def send(tensor, dst: int | None = None, group=None, tag: int = 0,
         group_dst: int | None = None) -> None:
    """Send ``tensor`` to process ``dst`` (global rank); blocks until it is received."""
    world = _world("send")
    dst = _peer(world, group, dst, group_dst, "dst", "send")
    queues().call(("send", dst), lambda: _do_send(world, tensor, dst, tag))


def recv(tensor, src: int | None = None, group=None, tag: int = 0,
         group_src: int | None = None):
    """Receive into ``tensor``'s shape and dtype from ``src`` (None = any sender).

    Returns ``(sender rank, received array)``; a numpy ``tensor`` is also filled in place
    (torch returns only the sender rank and fills ``tensor``; jax arrays are immutable,
    hence the pair).
    """
    check_kept(tensor, "recv", "tensor")
    world = _world("recv")
    if src is not None or group_src is not None:
        src = _peer(world, group, src, group_src, "src", "recv")
    key = ("recv", src if src is not None else "any")
    return queues().call(key, lambda: _do_recv(world, tensor, src, tag))


def isend(tensor, dst: int | None = None, group=None, tag: int = 0,
          group_dst: int | None = None):
    """Start sending ``tensor`` to ``dst``; returns a ``Work`` (``wait()`` returns None)."""
    from jdist.collectives._work import Work

    world = _world("isend")
    dst = _peer(world, group, dst, group_dst, "dst", "isend")
    fut = queues().submit(("send", dst), lambda: _do_send(world, tensor, dst, tag))
    return Work(fut, f"isend to rank {dst}")


def irecv(tensor, src: int | None = None, group=None, tag: int = 0,
          group_src: int | None = None):
    """Start receiving from ``src``; ``wait()`` returns ``(sender rank, array)``."""
    from jdist.collectives._work import Work

    world = _world("irecv")
    if src is not None or group_src is not None:
        src = _peer(world, group, src, group_src, "src", "irecv")
    key = ("recv", src if src is not None else "any")
    fut = queues().submit(key, lambda: _do_recv(world, tensor, src, tag))
    return Work(fut, f"irecv from rank {src if src is not None else 'any'}")


class P2POp(NamedTuple):
    """One point-to-point operation for :func:`batch_isend_irecv` (torch's ``P2POp``).

    Attributes:
      op: ``jdist.isend`` or ``jdist.irecv``.
      tensor: the array to send, or the buffer giving the received shape and dtype.
      peer: the other process's global rank.
      group: the process group (default WORLD).
      tag: message tag.
    """

    op: Callable
    tensor: Any
    peer: int | None = None
    group: Any = None
    tag: int = 0


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list:
    """Start every operation of the list; returns their ``Work`` handles, in order."""
    if not p2p_op_list or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise ValueError("batch_isend_irecv expects a non-empty list of jdist.P2POp")
    for p in p2p_op_list:
        if p.op not in (isend, irecv):
            raise ValueError(f"P2POp.op must be jdist.isend or jdist.irecv, got {p.op!r}")
    return [p.op(p.tensor, p.peer, p.group, p.tag) for p in p2p_op_list]
