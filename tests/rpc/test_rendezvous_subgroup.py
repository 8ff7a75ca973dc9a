"""init_rpc(env://) in a job where only some processes formed a process group.

torch rendezvouses RPC on ``init_method``; jdist reuses the process group's store only
when the RPC job is that group's own set of processes. Here ranks 0 and 1 form a 2-process
group of their own (``tcp://``) and then all 4 processes start RPC on ``env://``: with the
group's store reused, ranks 0-1 and 2-3 waited on two different stores until the
rendezvous timeout.
"""

from __future__ import annotations

import os

from jdist.store import free_port
from tests.helpers import run_procs


def _pair_then_rpc(port: int) -> dict:
    import jdist
    from jdist import rpc

    rank = int(os.environ["RANK"])
    if rank < 2:
        jdist.init_process_group("gloo", rank=rank, world_size=2,
                                 init_method=f"tcp://127.0.0.1:{port}")
    opts = rpc.RpcBackendOptions(rendezvous_timeout=60)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=4, rpc_backend_options=opts)
    total = rpc.rpc_sync(f"w{(rank + 1) % 4}", sum, args=([rank, 10],))
    rpc.shutdown()
    if rank < 2:
        jdist.destroy_process_group()
    return {"total": total}


def test_rpc_over_all_processes_beside_a_smaller_process_group():
    results = run_procs(_pair_then_rpc, 4, args=(free_port("127.0.0.1"),), timeout=150)
    assert [r["total"] for r in results] == [10, 11, 12, 13]
