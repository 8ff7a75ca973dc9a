"""Fixtures for RPC tests: several agents in this process (in-process or TCP transport)."""

from __future__ import annotations

import threading

import pytest

from jdist.rpc._api import start_agent, stop_agent
from jdist.rpc._options import RpcBackendOptions
from jdist.store import HashStore

SECRET = b"test-secret"


def make_agents(n, transport="inproc", **opts):
    """Start ``n`` agents named w0..w{n-1} that rendezvous through one HashStore."""
    store = HashStore()
    options = RpcBackendOptions(transport=transport, rpc_timeout=opts.pop("rpc_timeout", 20),
                                **opts)
    agents = [None] * n
    errors = []

    def go(r):
        try:
            agents[r] = start_agent(f"w{r}", r, n, options, store, SECRET)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return agents


def stop_all(agents, graceful=True, timeout=10.0):
    """Shut every agent down in parallel; return the exceptions raised (by rank)."""
    out = {}

    def go(r, a):
        try:
            stop_agent(a, graceful, timeout)
        except BaseException as e:
            out[r] = e

    threads = [threading.Thread(target=go, args=(r, a)) for r, a in enumerate(agents)
               if a is not None and a.state != "closed"]
    for t in threads:
        t.start()
    for t in threads:
        t.join((timeout or 50) + 10)
    return out


@pytest.fixture
def agents3():
    agents = make_agents(3)
    yield agents
    stop_all(agents, graceful=False)
