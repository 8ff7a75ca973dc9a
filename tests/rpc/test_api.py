"""The public functions on this process's singleton agent (world of one, in-process)."""

from __future__ import annotations

import operator

import numpy as np
import pytest

from jdist import rpc
from jdist.errors import AlreadyInitializedError, NotInitializedError, RpcTimeoutError
from jdist.rpc._options import resolve_timeout
from jdist.store import HashStore


def options(**kw):
    return rpc.RpcBackendOptions(init_method=HashStore(), transport="inproc",
                                 auth_token="t", rpc_timeout=10, **kw)


def test_public_names():
    for name in ["init_rpc", "shutdown", "rpc_sync", "rpc_async", "remote", "get_worker_info",
                 "RRef", "Future", "WorkerInfo", "RpcBackendOptions", "wait_all", "collect_all",
                 "functions", "TensorPipeRpcBackendOptions"]:
        assert name in rpc.__all__ and hasattr(rpc, name), name
    assert rpc.functions.async_execution


def test_not_initialized_errors_name_the_fix():
    with pytest.raises(NotInitializedError, match="call jdist.rpc.init_rpc"):
        rpc.rpc_sync("w0", operator.add, (1, 2))
    with pytest.raises(NotInitializedError, match="init_rpc"):
        rpc.RRef(3)
    with pytest.raises(NotInitializedError, match="nothing to shut down"):
        rpc.shutdown()


def test_world_of_one_full_cycle():
    rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=options())
    try:
        with pytest.raises(AlreadyInitializedError, match="shutdown"):
            rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=options())
        assert rpc.get_worker_info() == rpc.WorkerInfo(0, "solo")
        assert rpc.rpc_sync("solo", operator.add, (1, 2)) == 3
        assert rpc.rpc_async(0, np.sum, (np.ones(4),)).wait() == 4.0
        r = rpc.remote("solo", np.arange, (3,))
        assert r.is_owner() and list(r.to_here()) == [0, 1, 2]
        local = rpc.RRef([1, 2])
        assert local.is_owner() and local.local_value() == [1, 2]
        assert local.rpc_sync().count(2) == 1
        assert local.owner_name() == "solo" and local.confirmed_by_owner()
    finally:
        rpc.shutdown()
    with pytest.raises(NotInitializedError):
        rpc.get_worker_info()


def test_init_argument_errors(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match=r"\$RANK is not set"):
        rpc.init_rpc("a", world_size=1, rpc_backend_options=options())
    with pytest.raises(ValueError, match="worker name"):
        rpc.init_rpc("", rank=0, world_size=1, rpc_backend_options=options())
    with pytest.raises(TypeError, match="RpcBackendOptions"):
        rpc.init_rpc("a", rank=0, world_size=1, rpc_backend_options={"rpc_timeout": 1})
    with pytest.raises(ValueError, match=r"rank must be in 0\.\.0"):
        rpc.init_rpc("a", rank=3, world_size=1, rpc_backend_options=options())
    with pytest.raises(ValueError, match="init_method must be"):
        rpc.init_rpc("a", rank=0, world_size=1,
                     rpc_backend_options=rpc.RpcBackendOptions(init_method="file:///x"))


@pytest.mark.parametrize("kw,match", [
    ({"rpc_timeout": -2}, "rpc_timeout"),
    ({"num_worker_threads": 0}, "num_worker_threads"),
    ({"max_frame_bytes": 10}, "max_frame_bytes"),
    ({"transport": "udp"}, "transport"),
    ({"shutdown_timeout": 0}, "shutdown_timeout"),
])
def test_options_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        rpc.RpcBackendOptions(**kw)


def test_auth_token_defaults_to_env(monkeypatch):
    monkeypatch.setenv("JDIST_AUTH_TOKEN", "from-env")
    assert rpc.RpcBackendOptions().auth_key() == b"from-env"
    assert rpc.RpcBackendOptions(auth_token="given").auth_key() == b"given"
    monkeypatch.delenv("JDIST_AUTH_TOKEN")
    assert rpc.RpcBackendOptions().auth_key() is None


def test_timeout_convention():
    assert resolve_timeout(-1, 60.0) == 60.0
    assert resolve_timeout(0, 60.0) is None
    assert resolve_timeout(2, 60.0) == 2.0
    with pytest.raises(ValueError, match="-1 for the default"):
        resolve_timeout(-3, 60.0)


def test_future_wait_timeout_is_rpc_timeout_error():
    f = rpc.Future()
    with pytest.raises(RpcTimeoutError, match="0.01 s"):
        f.wait(0.01)


def test_no_secret_anywhere_shares_one_through_the_store(monkeypatch):
    import threading

    from jdist.rpc._api import start_agent, stop_agent

    monkeypatch.delenv("JDIST_AUTH_TOKEN", raising=False)
    store = HashStore()
    opts = rpc.RpcBackendOptions(transport="inproc", rpc_timeout=10)
    agents = [None, None]

    def go(r):
        agents[r] = start_agent(f"n{r}", r, 2, opts, store)

    with pytest.warns(RuntimeWarning, match="JDIST_AUTH_TOKEN"):
        threads = [threading.Thread(target=go, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    try:
        assert agents[0]._key == agents[1]._key and len(agents[0]._key) == 64
        assert agents[0].rpc_async("n1", operator.add, (2, 2)).wait(10) == 4
    finally:
        for a in agents:
            stop_agent(a, graceful=False)


def test_device_maps_are_a_named_departure():
    """torch's TensorPipe device maps do not exist in jdist: None/empty accepted, any
    map refused with the fix (docs/migration.md names the departure)."""
    assert rpc.RpcBackendOptions(device_maps=None, devices=[]).device_maps is None
    with pytest.raises(ValueError, match=r"no device maps \(got \{'w1': \{0: 1\}\}\).*device_put"):
        rpc.RpcBackendOptions(device_maps={"w1": {0: 1}})
    with pytest.raises(ValueError, match="no device maps.*device_put"):
        rpc.RpcBackendOptions().set_device_map("w1", {0: 1})
    with pytest.raises(ValueError, match="no device maps"):
        rpc.RpcBackendOptions().set_devices(["cuda:0"])
