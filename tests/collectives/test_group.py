"""Process groups in one process: parsing, errors, the embedded (no network) mode.

Real multi-process jobs are in ``test_group_multiproc.py``.
"""

from __future__ import annotations

from datetime import timedelta

import jax
import numpy as np
import pytest

import jdist
from jdist.collectives import _rendezvous as rdzv
from jdist.errors import AlreadyInitializedError, GroupMismatchError, NotInitializedError


@pytest.fixture
def clean_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    if jdist.is_initialized():
        jdist.destroy_process_group()
    yield monkeypatch
    if jdist.is_initialized():
        jdist.destroy_process_group()


# ------------------------------------------------------------------ pure parsing


def test_parse_env_embedded_and_errors():
    assert rdzv.parse_init(None, -1, -1, None, env={}) == rdzv.InitSpec("env", 0, 1)
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert rdzv.parse_init("env://", -1, -1, None, env=env) == rdzv.InitSpec(
        "env", 1, 2, "127.0.0.1", 29500)
    for missing in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        e = {k: v for k, v in env.items() if k != missing}
        with pytest.raises(ValueError, match=f"environment variable {missing} expected"):
            rdzv.parse_init("env://", -1, -1, None, env=e)
    with pytest.raises(ValueError, match=r"Invalid rank 5, rank should be in the interval "
                                         r"\[0, 1\]"):
        rdzv.parse_init("env://", -1, 5, None, env=env)


def test_parse_tcp_file_store_and_conflicts():
    spec = rdzv.parse_init("tcp://127.0.0.1:1234?rank=1&world_size=3", -1, -1, None, env={})
    assert spec == rdzv.InitSpec("tcp", 1, 3, "127.0.0.1", 1234)
    assert rdzv.parse_init("file:///tmp/x?world_size=2", -1, 0, None, env={}).path == "/tmp/x"
    with pytest.raises(ValueError, match="rank=0 and rank=1"):
        rdzv.parse_init("tcp://127.0.0.1:1?rank=1&world_size=2", -1, 0, None, env={})
    with pytest.raises(ValueError, match="needs rank and world_size"):
        rdzv.parse_init("tcp://127.0.0.1:1", -1, -1, None, env={})
    with pytest.raises(ValueError, match="Cannot specify both init_method and store"):
        rdzv.parse_init("env://", 2, 0, object(), env={})
    with pytest.raises(ValueError, match="needs world_size > 0 and rank >= 0"):
        rdzv.parse_init(None, -1, 0, object(), env={})
    with pytest.raises(ValueError, match="not supported"):
        rdzv.parse_init("udp://x:1", 1, 0, None, env={})
    assert rdzv.parse_timeout(timedelta(seconds=3)) == 3.0
    assert rdzv.parse_timeout(None) == 1800.0
    with pytest.raises(ValueError, match="-1"):
        rdzv.parse_timeout(-1)


# ------------------------------------------------------------- embedded (1 process)


def test_before_init_everything_raises(clean_env):
    assert not jdist.is_initialized()
    for call in (jdist.get_rank, jdist.get_world_size, jdist.get_backend,
                 jdist.get_default_group, jdist.destroy_process_group,
                 lambda: jdist.new_group([0]), jdist.barrier,
                 lambda: jdist.all_reduce(np.ones(2)),
                 lambda: jdist.all_gather_object(None, 1),
                 lambda: jdist.send(np.ones(2), 1)):
        with pytest.raises(NotInitializedError, match="init_process_group"):
            call()


def test_embedded_init_destroy_reinit(clean_env):
    jdist.init_process_group(timeout=timedelta(seconds=5))
    world = jdist.get_default_group()
    assert (jdist.get_rank(), jdist.get_world_size(), jdist.get_backend()) == (0, 1, "gloo")
    assert world.mesh.devices.size == len(jax.devices()) == 8
    assert world.mesh.axis_names == ("dp",) and world.timeout == 5.0
    with pytest.raises(AlreadyInitializedError,
                       match="trying to initialize the default process group twice!"):
        jdist.init_process_group()
    x = np.arange(6, dtype=np.float32)
    np.testing.assert_array_equal(jdist.all_reduce(x.copy(), jdist.ReduceOp.MAX), x)
    sub = jdist.new_group([0])
    assert sub.axis_name != world.axis_name and sub.mesh.devices.size == 8
    assert jdist.get_global_rank(sub, 0) == 0 and jdist.get_group_rank(sub, 0) == 0
    with pytest.raises(GroupMismatchError, match="group_rank 3"):
        jdist.get_global_rank(sub, 3)
    with pytest.raises(GroupMismatchError, match="Global rank 4 is not part of group"):
        jdist.get_group_rank(sub, 4)
    with pytest.raises(GroupMismatchError, match="invalid root rank: src=2"):
        jdist.broadcast(x.copy(), src=2, group=sub)
    for query in (jdist.get_backend, jdist.get_process_group_ranks):
        with pytest.raises(GroupMismatchError, match="Invalid process group specified"):
            query(jdist.NON_GROUP_MEMBER)
    with pytest.warns(UserWarning, match="does not belong to the given group"):
        assert jdist.all_reduce(x.copy(), group=jdist.NON_GROUP_MEMBER) is None
    with pytest.raises(ValueError, match=r"\[5\]"):
        jdist.new_group([0, 5])
    jdist.destroy_process_group()
    assert not jdist.is_initialized()
    jdist.init_process_group("gloo", world_size=1, rank=0)
    assert jdist.all_gather_object(None, {"a": 1}) == [{"a": 1}]
    jdist.destroy_process_group()


def test_bad_backend_and_rank(clean_env):
    with pytest.raises(ValueError, match="'mpi' is not supported"):
        jdist.init_process_group("mpi")
    with pytest.raises(ValueError, match="does not match JAX's platform 'cpu'"):
        jdist.init_process_group("nccl")
    assert not jdist.is_initialized()
    with pytest.raises(ValueError, match="Invalid rank 3"):
        jdist.init_process_group(init_method="tcp://127.0.0.1:1", world_size=2, rank=3)
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("RANK", "0")
    with pytest.raises(ValueError, match="environment variable MASTER_ADDR expected"):
        jdist.init_process_group()


def test_world_size_mismatch_reaches_a_rank_that_is_slow_to_read_it():
    """Rank 0 keeps its store up until the rank that arrived has read the mismatch,
    however slow that rank is (CI saw a rank that read it late and then spent its
    whole timeout reconnecting to a store that was gone)."""
    import threading
    import time

    from jdist.errors import RendezvousError
    from jdist.store import TCPStore, free_port

    port, errors = free_port(), {}

    class Slow:  # rank 1 reads the store late, after rank 0 has seen its claim
        def __init__(self, store):
            self.store, self.polls = store, 0

        def check(self, keys):
            self.polls += 1
            if self.polls == 1:
                time.sleep(2.5)
            return self.store.check(keys)

        def __getattr__(self, name):
            return getattr(self.store, name)

    def run(rank: int) -> None:
        n = 2 + rank
        spec = rdzv.InitSpec("tcp", rank, n, "127.0.0.1", port)
        store = TCPStore("127.0.0.1", port, n, rank == 0, timedelta(seconds=10),
                         wait_for_workers=False)
        try:
            rdzv.rendezvous(store if rank == 0 else Slow(store), spec, 10.0, 1, "127.0.0.1")
        except RendezvousError as e:
            errors[rank] = str(e)
        finally:
            del store  # rank 0's server stops with its last reference, as in init

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(errors) == [0, 1], errors
    assert all("world size mismatch" in m for m in errors.values()), errors
