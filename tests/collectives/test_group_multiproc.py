"""Process groups in real processes (2 and 4): ranks, devices, meshes, sub-groups,
re-initialization, and rendezvous failures that name the problem.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import jax
import numpy as np

from jdist.errors import AlreadyInitializedError, RendezvousError, RendezvousTimeoutError
from jdist.launch import free_port
from tests.helpers import run_procs


def _group_child() -> dict:
    import jdist

    t = time.time()
    jdist.init_process_group(timeout=60)
    r, n = jdist.get_rank(), jdist.get_world_size()
    world = jdist.get_default_group()
    out = {
        "rank": r, "world": n, "backend": jdist.get_backend(),
        "local": [d.id for d in jax.local_devices()],
        "mesh": [d.id for d in world.mesh.devices.flat],
        "per_rank": [[d.id for d in ds] for ds in world.devices_per_rank],
        "init_s": time.time() - t,
    }
    try:
        jdist.init_process_group()
    except AlreadyInitializedError as e:
        out["twice"] = str(e)
    evens, odds = jdist.new_group([0, 2]), jdist.new_group([1, 3])
    mine = evens if r % 2 == 0 else odds
    other = odds if r % 2 == 0 else evens
    assert other is jdist.NON_GROUP_MEMBER and jdist.get_rank(other) == -1
    out["sub"] = (jdist.get_rank(mine), jdist.get_world_size(mine),
                  [jdist.get_global_rank(mine, i) for i in range(2)], mine.axis_name,
                  [d.id for d in mine.mesh.devices.flat])
    out["sub_sum"] = jdist.all_reduce(np.array([r], np.int32), group=mine).tolist()
    out["sum"] = jdist.all_reduce(np.array([r], np.int32)).tolist()
    # the global mesh works inside shard_map across processes (in-graph psum)
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = NamedSharding(world.mesh, PartitionSpec("dp"))
    local = np.full((len(jax.local_devices()),), r + 1.0, np.float32)
    arr = jax.make_array_from_process_local_data(sharding, local)
    f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "dp"), mesh=world.mesh,
                              in_specs=PartitionSpec("dp"), out_specs=PartitionSpec("dp")))
    out["psum"] = float(np.asarray(f(arr).addressable_data(0))[0])
    jdist.destroy_process_group()
    # a second job in the same processes
    jdist.init_process_group(timeout=60)
    out["again"] = jdist.all_reduce(np.array([1.0])).tolist()
    jdist.destroy_process_group()
    return out


def test_process_groups_in_4_processes():
    res = run_procs(_group_child, 4, devices_per_proc=2, timeout=180)
    all_ids = sorted(i for r in res for i in r["local"])
    for r, out in enumerate(res):
        assert (out["rank"], out["world"], out["backend"]) == (r, 4, "gloo")
        assert len(out["local"]) == 2 and out["per_rank"][r] == out["local"]
        assert sorted(out["mesh"]) == all_ids and len(out["mesh"]) == 8
        assert out["mesh"] == [i for ids in out["per_rank"] for i in ids]  # process-major
        assert "trying to initialize the default process group twice!" in out["twice"]
        members = [0, 2] if r % 2 == 0 else [1, 3]
        assert out["sub"][:3] == (members.index(r), 2, members)
        assert out["sub"][3] != "dp"
        assert sorted(out["sub"][4]) == sorted(
            i for m in members for i in res[m]["local"])
        assert out["sub_sum"] == [sum(members)] and out["sum"] == [6]
        assert out["psum"] == 2 * (1 + 2 + 3 + 4)
        assert out["again"] == [4.0]


def _rendezvous_failures(port_missing: int, port_ws: int, port_dup: int,
                         port_ok: int) -> dict:
    import jdist

    r = int(os.environ["RANK"])
    out = {}
    t = time.monotonic()
    try:  # world_size 3, but only ranks 0 and 1 exist
        jdist.init_process_group(init_method=f"tcp://127.0.0.1:{port_missing}",
                                 world_size=3, rank=r, timeout=3)
    except RendezvousTimeoutError as e:
        out["missing"] = (str(e), time.monotonic() - t)
    try:  # the two ranks disagree about the world size
        jdist.init_process_group(init_method=f"tcp://127.0.0.1:{port_ws}",
                                 world_size=2 + r, rank=r, timeout=10)
    except RendezvousError as e:
        out["world_size"] = str(e)
    from jdist.store import TCPStore

    store = TCPStore("127.0.0.1", port_dup, 2, r == 0, timedelta(seconds=10),
                     wait_for_workers=False)
    try:  # both claim rank 0 through an explicit store
        jdist.init_process_group(store=store, world_size=2, rank=0, timeout=3)
    except RendezvousError as e:
        out["dup"] = str(e)
    out["initialized"] = jdist.is_initialized()
    # monitored_barrier names the rank that is late; the late rank learns it failed
    from jdist.errors import CollectiveTimeoutError

    jdist.init_process_group(init_method=f"tcp://127.0.0.1:{port_ok}", world_size=2,
                             rank=r, timeout=30)
    if r == 1:
        time.sleep(2.5)
    try:
        jdist.monitored_barrier(timeout=timedelta(seconds=1))
    except CollectiveTimeoutError as e:
        out["monitored"] = str(e)
    jdist.monitored_barrier(timeout=30)  # both on time now
    jdist.destroy_process_group()
    return out


def test_rendezvous_failures_name_the_problem():
    ports = (free_port(), free_port(), free_port(), free_port())
    res = run_procs(_rendezvous_failures, 2, args=ports, timeout=120)
    for out in res:
        msg, dt = out["missing"]
        assert "ranks [2]" in msg and "never arrived" in msg, msg
        assert dt < 3 + 5, dt
        assert "world size mismatch" in out["world_size"], out
        assert not out["initialized"]
    assert res[0]["monitored"].startswith("[Rank 0]: Rank 1 failed to pass monitoredBarrier "
                                          "in 1000 ms"), res[0]
    assert "Rank 1 successfully reached monitoredBarrier, but received errors" in res[1][
        "monitored"], res[1]
    # one claims rank 0 first and then times out waiting for rank 1; the other is refused
    dups = sorted(out["dup"] for out in res)
    assert sum("rank 0 was claimed twice" in d for d in dups) == 1, dups
    assert sum("ranks [1]" in d for d in dups) == 1, dups
