"""examples/rpc_parameter_server.py in 3 real processes (TCP): both trainers learn.

The trainers' forward passes are differentiable RPCs to the server's RRef (through the
RRef proxy), the gradients wait in the contexts on the server and each trainer's
DistributedOptimizer applies them there.
"""

from __future__ import annotations

from tests.helpers import run_procs


def _rank_main(argv):
    from examples.rpc_parameter_server import main

    return main(argv)


def test_parameter_server_example_learns():
    out = run_procs(_rank_main, 3, args=(["--smoke"],), timeout=240)[0]
    for who in ("trainer1", "trainer2"):
        res = out[who]
        assert len(res["losses"]) == 30
        assert res["acc_before"] < 0.5 < res["acc_after"], res
        assert sum(res["losses"][-5:]) < 0.7 * sum(res["losses"][:5]), res["losses"]
