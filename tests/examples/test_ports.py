"""pytorch/examples' distributed programs ported to jdist (examples/ports/) against
their torch twins: one jdist-run launch and one torchrun launch per program, short
mode, the same data and initial weights (torch's init, converted with
``jdist.testing.state_dict_to_nnx``), compared to 1e-5 where the program is
deterministic. A twin's results are recorded per torch version and inputs
(``tests/examples/_torch_results.py``; ``JDIST_TORCH_RERUN=1`` runs them again and
checks the record).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

from examples.ports._common import save_init
from examples.ports._run import HERE
from tests.examples._torch_results import run_both_cached

TOL = 1e-5
sys.path.insert(0, HERE)  # the twins import their siblings (_common, _data) by name


def as_torch_names(params: dict) -> dict:
    """jdist's ``{("net1", "kernel"): a}`` as torch's ``{"net1.weight": a.T}``."""
    names = {"kernel": "weight", "embedding": "weight", "scale": "weight",
             "mean": "running_mean", "var": "running_var"}
    out = {}
    for path, a in params.items():
        a = np.asarray(a)
        if path[-1] == "kernel":
            a = a.T if a.ndim == 2 else np.transpose(a, (a.ndim - 1, a.ndim - 2,
                                                         *range(a.ndim - 2)))
        out[".".join(map(str, (*path[:-1], names.get(path[-1], path[-1]))))] = a
    return out


def assert_params_close(mine: dict, theirs: dict, tol=TOL):
    mine = as_torch_names(mine)
    assert sorted(mine) == sorted(theirs)
    for k in theirs:
        np.testing.assert_allclose(mine[k], theirs[k], rtol=tol, atol=tol, err_msg=k)


def init_file(tmp_path, module: torch.nn.Module) -> str:
    return save_init(str(tmp_path / "init.npz"), module.state_dict())


def test_ddp_example(tmp_path):
    from ddp_example_torch import ToyModel

    torch.manual_seed(0)
    start = ToyModel()
    init = init_file(tmp_path, start)
    mine, theirs = run_both_cached("ddp_example", 2, ["--smoke", "--init", init], timeout=150,
                                   tmp=str(tmp_path / "runs"))
    for r in (0, 1):
        assert "training completed in rank" in mine["log"]
        np.testing.assert_allclose(mine[r]["losses"], theirs[r]["losses"], rtol=TOL)
        assert_params_close(mine[r]["params"], theirs[r]["params"])
    moved = max(np.abs(theirs[0]["params"][k] - v.detach().numpy()).max()
                for k, v in start.state_dict().items())
    assert moved > 1e-4  # three SGD steps changed the weights


@pytest.mark.slow(seconds=10)  # one of the three longest launches of this file
def test_ddp_tutorial_crash_and_resume_from_snapshot(tmp_path):
    """3 epochs, a snapshot every epoch, rank 0 dies after epoch 1 of the first attempt;
    the restart (jdist-run --max-restarts 1) resumes from the snapshot."""
    torch.manual_seed(0)
    init = init_file(tmp_path, torch.nn.Linear(20, 1))

    def args(lib, out):
        return ["3", "1", "--smoke", "--crash-after-epoch", "1", "--init", init,
                "--snapshot-path", os.path.join(out, "snapshot")]

    mine, theirs = run_both_cached("ddp_tutorial", 2, args, timeout=240, tmp=str(tmp_path / "runs"),
                                   launcher_args=["--max-restarts", "1"], relaunch_torch=True)
    assert "rank 0 crashes after epoch 1" in mine["log"]
    assert "Resuming training from snapshot at Epoch 1" in mine["log"]
    assert "RepeatedEpochWarning" not in mine["log"]
    for r in (0, 1):
        assert mine[r]["resumed"] and theirs[r]["resumed"]
        # epochs 1 and 2 after the restart (the tutorial resumes at the saved epoch)
        assert len(mine[r]["losses"]) == len(theirs[r]["losses"]) == 2 * 4
        np.testing.assert_allclose(mine[r]["losses"], theirs[r]["losses"], rtol=TOL)
        assert_params_close(mine[r]["params"], theirs[r]["params"])


def test_rpc_parameter_server(tmp_path):
    """One server and one trainer (two trainers update the server without coordination,
    as in torch: their numbers depend on timing); dropout off for the comparison."""
    from rpc_parameter_server_torch import Net

    torch.manual_seed(0)
    start = Net()
    init = init_file(tmp_path, start)
    mine, theirs = run_both_cached("rpc_parameter_server", 2,
                                   ["--smoke", "--no-dropout", "--init", init], timeout=240,
                                   tmp=str(tmp_path / "runs"))
    assert "RPC shutdown on parameter server." in mine["log"]
    np.testing.assert_allclose(mine[1]["losses"], theirs[1]["losses"], rtol=TOL)
    assert mine[1]["accuracy"] == theirs[1]["accuracy"]
    assert_params_close(mine[1]["params"], theirs[1]["params"])
    moved = max(np.abs(theirs[1]["params"][k] - v.detach().numpy()).max()
                for k, v in start.state_dict().items())
    assert moved > 1e-4


def test_rpc_batch_parameter_server(tmp_path):
    """Two trainers, batch_update_size 2: the @async_execution update completes both
    trainers' futures with the model after one averaged SGD-momentum step. Started as
    the original is, by the script itself: jdist.launch.spawn / torch's mp.spawn."""
    from rpc_batch_ps_torch import Model

    from examples.ports._run import fresh_port

    torch.manual_seed(0)
    init = init_file(tmp_path, Model())

    def args(lib, out):
        port = ["--master-port", str(fresh_port())] if lib == "torch" else []
        return ["--smoke", "--batch-update-size", "2", "--init", init, *port]

    mine, theirs = run_both_cached("rpc_batch_ps", 3, args, timeout=240, spawn=True,
                                   tmp=str(tmp_path / "runs"))
    assert mine["log"].count("PS updated model") == 3
    assert "[rank 1]" in mine["log"]  # spawn forwards the children's output
    for a, b in zip(mine[0]["trainers"], theirs[0]["trainers"], strict=True):
        np.testing.assert_allclose(a["losses"], b["losses"], rtol=TOL)
    assert_params_close(mine[0]["params"], theirs[0]["params"])
    losses = mine[0]["trainers"][0]["losses"]
    assert losses[-1] < losses[0]  # the fetched models were the updated ones


@pytest.mark.slow(seconds=10)  # one of the three longest launches of this file
def test_ddp_rpc_hybrid_model(tmp_path):
    """master + ps + two DDP trainers; variable-size bags; --deterministic (a barrier
    of the trainers after each step) so both runs read the same table. Then jdist again
    with --pad (the same batches in fixed, masked shapes: one compilation), which must
    give torch's numbers too."""
    from examples.ports._run import fresh_port, run_one

    torch.manual_seed(0)
    fc = torch.nn.Linear(16, 8)
    start = torch.nn.EmbeddingBag(100, 16, mode="sum").weight.detach().numpy().copy()
    init = save_init(str(tmp_path / "init.npz"), {
        "emb.weight": torch.from_numpy(start),
        **{f"fc.{k}": v for k, v in fc.state_dict().items()}})

    def args(lib=None, out=None):
        return ["--smoke", "--deterministic", "--init", init,
                "--pg-port", str(fresh_port()), "--rpc-port", str(fresh_port())]

    mine, theirs = run_both_cached("ddp_rpc", 4, args, timeout=300, tmp=str(tmp_path / "runs"))
    padded = run_one("jdist", "ddp_rpc", 4, args() + ["--pad"], timeout=240,
                     tmp=str(tmp_path / "padded"))
    assert np.abs(theirs[2]["table"] - start).max() > 1e-3
    for run in (mine, padded):
        assert run["log"].count("Training done for epoch 0") == 2
        np.testing.assert_allclose(run[2]["table"], theirs[2]["table"], rtol=TOL, atol=TOL)
        for a, b in zip(run[2]["trainers"], theirs[2]["trainers"], strict=True):
            np.testing.assert_allclose(a["losses"], b["losses"], rtol=TOL)
            assert_params_close(a["fc"], b["fc"])
        # DDP kept the dense layer identical on both trainers
        for k, v in run[2]["trainers"][0]["fc"].items():
            np.testing.assert_array_equal(v, run[2]["trainers"][1]["fc"][k])


@pytest.mark.slow(seconds=10)  # one of the three longest launches of this file
def test_rpc_pipeline(tmp_path):
    """Two shards on two workers, 4 micro-batches per batch; the master hands worker1's
    output RRef to worker2: both shards must get their gradients (torch's update)."""
    from rpc_pipeline_torch import Shard1, Shard2

    torch.manual_seed(0)
    s1, s2 = Shard1(), Shard2()
    init = save_init(str(tmp_path / "init.npz"), {
        **{f"p1.{k}": v for k, v in s1.state_dict().items()},
        **{f"p2.{k}": v for k, v in s2.state_dict().items()}})
    mine, theirs = run_both_cached("rpc_pipeline", 3, ["--smoke", "--init", init], timeout=300,
                                   tmp=str(tmp_path / "runs"))
    np.testing.assert_allclose(mine[0]["losses"], theirs[0]["losses"], rtol=TOL)
    for shard, start in (("p1", s1), ("p2", s2)):
        assert_params_close(mine[0][shard], theirs[0][shard])
        moved = max(np.abs(theirs[0][shard][k] - start.state_dict()[k].numpy()).max()
                    for k in theirs[0][shard])
        assert moved > 1e-4, shard
    # BatchNorm running means moved (not compared: the micro-batches reach a shard
    # concurrently, and the order of the running-average updates differs run to run,
    # in torch too)
    for a in mine[0]["means"]:
        assert np.abs(a["bn"]).max() > 1e-3


def test_our_rpc_programs_run(tmp_path):
    """The two RPC programs of our own that benchmarks/ports.py times against torch (an
    RNN over a parameter server, a policy server), smoke mode, jdist side: they train
    (compiled passes from the second step: the RNN's loss falls) and time their steps."""
    from examples.ports._run import run_one

    rnn = run_one("jdist", "rpc_rnn", 2, ["--smoke"], timeout=240, tmp=str(tmp_path / "rnn"))
    losses = rnn[1]["losses"]
    assert len(losses) == len(rnn[1]["times"]) == 6 and np.all(np.isfinite(losses))
    assert losses[-1] < losses[0]
    policy = run_one("jdist", "rpc_policy", 3, ["--smoke"], timeout=240,
                     tmp=str(tmp_path / "policy"))
    for r in (1, 2):
        assert len(policy[r]["times"]) == 2 * 20 and len(policy[r]["losses"]) == 2
        assert np.all(np.isfinite(policy[r]["losses"]))
    assert "observer 2: 2 episodes" in policy["log"]
    assert sorted(policy[0]["params"]) and all(
        np.all(np.isfinite(v)) for v in policy[0]["params"].values())
