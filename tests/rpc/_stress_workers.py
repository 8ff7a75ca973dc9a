"""Code run in real processes by ``test_rref_stress.py``: RRef cycles across fresh sessions.

Every rank starts its cycles the moment its own ``init_rpc`` returns, so the first
messages of each session reach peers that may still be finishing their rendezvous, and
forward chains hand RRefs on between workers (a use can travel on another connection
than the ``remote()`` that creates the value).
"""

from __future__ import annotations

import gc
import os
import time
from datetime import timedelta

import numpy as np

from jdist.rpc import RpcBackendOptions, init_rpc, remote, rpc_sync, shutdown
from jdist.rpc._state import current_agent
from jdist.store import PrefixStore, TCPStore


def rref_forward_chain(dst: int, world_size: int, rref, ttl: int):
    """torch's ``rref_forward_chain``: remote() itself on, ``ttl`` hops, then fetch."""
    if ttl > 0:
        nxt = (dst + 1) % world_size
        return [remote(f"w{dst}", rref_forward_chain, (nxt, world_size, rref, ttl - 1))]
    return rref.to_here()


def owned_count() -> int:
    gc.collect()
    return len(current_agent().rrefs.owned)


def _all_done(store, key: str, world_size: int) -> None:
    """Wait until every rank has reached ``key`` (a store barrier: no RPC traffic)."""
    if store.add(key, 1) == world_size:
        store.set(f"{key}/all", "1")
    store.wait([f"{key}/all"], timedelta(seconds=120))


def run_sessions(sessions: int, cycles: int, ttl: int) -> dict:
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # what the process imported (torch, JAX, ...) is never garbage: out of the
    # collector's way, each gc.collect() below scans only this test's objects (0.15 s
    # of CPU each otherwise, nine per session)
    gc.freeze()
    base = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), ws, rank == 0)
    losses: list[str] = []
    ops = 0
    leftovers = []
    t0 = time.monotonic()
    for s in range(sessions):
        opts = RpcBackendOptions(init_method=PrefixStore(f"session{s}", base), rpc_timeout=30)
        init_rpc(f"w{rank}", rank=rank, world_size=ws, rpc_backend_options=opts)
        nxt = (rank + 1) % ws
        for c in range(cycles):
            n = c % 3 + 1
            expect = np.full((n,), float(c + rank + 1))
            try:
                first = remote(f"w{nxt}", np.add, (np.ones(n), float(c + rank)))
                ops += 1
                if c % 2:  # a plain remote -> to_here
                    got = first.to_here()
                    ops += 1
                else:  # torch's forward chain: each hop a remote() that forwards the RRef
                    out = rref_forward_chain(nxt, ws, first, ttl)
                    for _ in range(ttl):
                        assert isinstance(out, list) and len(out) == 1, out
                        out = out[0].to_here()
                    got = out
                    ops += 2 * ttl + 1
                np.testing.assert_array_equal(got, expect)
            except Exception as e:  # counted: every loss fails the test with its text
                losses.append(f"session {s} cycle {c}: {type(e).__name__}: {e}")
            del first
        gc.collect()
        # every value of this session is released once nobody holds it. The owners'
        # tables are read once every rank has finished its cycles (until then a slower
        # rank's RRefs are rightly held), so that polling with a gc.collect() on every
        # worker does not take the CPU from the ranks still working
        _all_done(base, f"session{s}/cycles_done", ws)
        deadline = time.monotonic() + 10
        while True:
            left = [rpc_sync(f"w{w}", owned_count) for w in range(ws)]
            if not any(left) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        leftovers.append(left)
        shutdown()
    base.close() if hasattr(base, "close") else None
    return {"losses": losses, "ops": ops, "leftovers": leftovers,
            "seconds": time.monotonic() - t0}
