"""Ranks, devices and one collective across processes.

Run it with the launcher (2 processes x 2 virtual CPU devices each)::

    jdist-run --nproc-per-node 2 --devices-per-proc 2 examples/demo_collectives.py

or alone (one process, all local devices, no network)::

    python examples/demo_collectives.py

Every process prints its rank, the world size and its devices, then takes part in one
``all_reduce`` (each contributes ``rank + 1``) and one in-graph ``psum`` over every
device of the job's mesh.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import jdist


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="(accepted; the demo is small)")
    parser.parse_args(argv)

    jdist.init_process_group()  # env:// (jdist-run sets RANK, WORLD_SIZE, MASTER_*)
    rank, world = jdist.get_rank(), jdist.get_world_size()
    group = jdist.get_default_group()
    local = [str(d) for d in jax.local_devices()]
    print(f"rank {rank} of {world} ({jdist.get_backend()}): local devices {local}; "
          f"the job's mesh has {group.mesh.devices.size} devices on axis "
          f"{group.axis_name!r}", flush=True)

    # eager, process-level: like torch.distributed.all_reduce
    total = jdist.all_reduce(np.array([rank + 1.0], np.float32))
    print(f"rank {rank}: all_reduce(rank + 1) = {total[0]:g} "
          f"(expected {world * (world + 1) / 2:g})", flush=True)

    # in-graph, device-level: a psum inside shard_map over every device of the job
    sharding = NamedSharding(group.mesh, PartitionSpec(group.axis_name))
    ones = np.ones((len(jax.local_devices()),), np.float32)
    count = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, group.axis_name),
                                  mesh=group.mesh, in_specs=PartitionSpec(group.axis_name),
                                  out_specs=PartitionSpec(group.axis_name)))(
        jax.make_array_from_process_local_data(sharding, ones))
    replicas = float(np.asarray(count.addressable_data(0))[0])
    print(f"rank {rank}: psum over the mesh counts {replicas:g} devices", flush=True)
    jdist.destroy_process_group()
    return {"rank": rank, "world": world, "sum": float(total[0]), "replicas": replicas}


if __name__ == "__main__":
    main()
