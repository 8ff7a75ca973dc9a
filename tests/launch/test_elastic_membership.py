"""Elastic membership of ``jdist-run --nnodes MIN:MAX`` launchers without ``--node-rank``
(torchrun's c10d rendezvous): the first launcher to bind the endpoint hosts the store,
node ranks follow the join order, every worker joins one process group, a launcher
that comes late joins a new round (no restart spent), and launchers that cannot join
say what they waited for or what disagrees.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import textwrap
import time

import pytest

from jdist.launch.__main__ import main
from jdist.store import free_port

_ALL_REDUCE = """\
    import json, os
    import numpy as np
    import jdist
    jdist.init_process_group(backend="gloo")
    rank, world = jdist.get_rank(), jdist.get_world_size()
    total = jdist.all_reduce(np.eye(world, dtype=np.int64)[rank])
    keys = ["RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"]
    print("ENV " + json.dumps({**{k: os.environ[k] for k in keys}, "sum": total.tolist()}))
    jdist.destroy_process_group()
"""

_WAIT_FOR_COMPANY = """\
    import json, os, sys, time
    keys = ["RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
            "TORCHELASTIC_RESTART_COUNT", "MASTER_PORT"]
    print("ENV " + json.dumps({k: os.environ[k] for k in keys}), flush=True)
    if os.environ["WORLD_SIZE"] == "1":  # alone: wait to be restarted with the late node
        open(os.path.join(sys.argv[1], "alone"), "w").close()
        time.sleep(60)
        sys.exit(3)
"""


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def _launcher(args: list[str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "JDIST_AUTH_TOKEN"}
    return subprocess.Popen([sys.executable, "-m", "jdist.launch", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _envs(stdout: str) -> list[dict]:
    return [json.loads(m) for m in re.findall(r"ENV (\{.*\})", stdout)]


def _finish(procs: list[subprocess.Popen], timeout: float = 90) -> list[tuple[str, str]]:
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()


def test_two_launchers_without_node_ranks_form_one_job_and_one_process_group(tmp_path):
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-timeout", "60",
              _script(tmp_path, _ALL_REDUCE)]
    procs = [_launcher(common), _launcher(common)]
    outs = _finish(procs)
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, "\n=====\n".join(e for _, e in outs)
        assert "cannot reach" not in err and "starting with 1 node" not in err
    envs = sorted((e for o, _ in outs for e in _envs(o)), key=lambda e: e["RANK"])
    assert [(e["RANK"], e["GROUP_RANK"]) for e in envs] == [("0", "0"), ("1", "1")]
    assert {(e["WORLD_SIZE"], e["GROUP_WORLD_SIZE"]) for e in envs} == {("2", "2")}
    assert [e["sum"] for e in envs] == [[1, 1], [1, 1]]  # one group of both nodes' ranks
    assert sorted(len(_envs(o)) for o, _ in outs) == [1, 1]  # one worker per launcher


def test_a_late_launcher_joins_a_new_round_without_spending_a_restart(tmp_path):
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint",
              f"127.0.0.1:{free_port()}", "--rdzv-conf", "last_call_timeout=0.5",
              "--max-restarts", "0", "--shutdown-timeout", "1", "--rdzv-timeout", "60",
              _script(tmp_path, _WAIT_FOR_COMPANY), str(tmp_path)]
    first = _launcher(common)
    deadline = time.monotonic() + 60
    while not (tmp_path / "alone").exists():  # the job runs with the first node only
        assert time.monotonic() < deadline and first.poll() is None, first.stderr.read()
        time.sleep(0.05)
    late = _launcher(common)
    (out0, err0), (out1, err1) = _finish([first, late])
    assert (first.returncode, late.returncode) == (0, 0), err0 + "\n=====\n" + err1
    assert "starting with 1 node of --nnodes 1:2" in err0
    assert ("the launcher of node 1 joined; restarting the job with it (attempt 2; "
            "--nnodes 1:2, no restart spent)") in err0
    assert "node 1 waits to join its next round" in err1
    before, *after = _envs(out0)
    assert (before["WORLD_SIZE"], before["GROUP_WORLD_SIZE"]) == ("1", "1")
    joined = after + _envs(out1)
    assert sorted((e["RANK"], e["GROUP_RANK"]) for e in joined) == [("0", "0"), ("1", "1")]
    assert {(e["WORLD_SIZE"], e["GROUP_WORLD_SIZE"]) for e in joined} == {("2", "2")}
    assert len({e["MASTER_PORT"] for e in joined}) == 1
    assert {e["TORCHELASTIC_RESTART_COUNT"] for e in joined} == {"0"}  # none spent


def test_a_launcher_beyond_max_waits_and_leaves_with_the_jobs_exit_code(tmp_path):
    script = _script(tmp_path, """\
        import os, sys, time
        open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"]), "w").close()
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(sys.argv[1], "go")):  # the extra waits
            assert time.monotonic() < deadline
            time.sleep(0.05)
        sys.exit(0 if os.environ["RANK"] == "0" else 4)
    """)
    common = ["--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
              "--rdzv-timeout", "60", script, str(tmp_path)]
    procs = [_launcher(common), _launcher(common)]
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"rank{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.05)
    extra = _launcher(common)  # the job is full: it waits, then leaves with the job
    ready, _, _ = select.select([extra.stderr], [], [], 60)
    waiting = extra.stderr.readline() if ready else ""  # (empty if it exits instead)
    (tmp_path / "go").touch()
    outs = _finish([*procs, extra])
    assert [p.returncode for p in procs + [extra]] == [4, 4, 4], outs
    assert "node 2 waits to join its next round" in waiting
    assert "the job ended (exit code 4) before this launcher could join it" in outs[2][1]
    assert outs[2][0] == ""  # it ran nothing


def test_too_few_launchers_time_out_naming_what_was_awaited(capsys):
    args = ["--nnodes", "2:3", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
            "--rdzv-timeout", "0.5", __file__]
    assert main(args) == 1
    assert ("1 of at least 2 launchers joined within --rdzv-timeout 0.5s; start them with "
            "the same --nnodes and --rdzv-endpoint") in capsys.readouterr().err


def test_launchers_that_disagree_are_refused_and_the_job_goes_on(tmp_path, capsys):
    endpoint = f"127.0.0.1:{free_port()}"
    script = _script(tmp_path, "print('ran')\n")
    host = _launcher(["--nnodes", "1:2", "--rdzv-endpoint", endpoint, "--rdzv-conf",
                      "last_call_timeout=4", script])
    deadline = time.monotonic() + 30
    while True:  # until the host listens
        capsys.readouterr()
        if main(["--nnodes", "1:3", "--rdzv-endpoint", endpoint, "--rdzv-conf",
                 "is_host=false,join_timeout=1", script]) == 1:
            err = capsys.readouterr().err
            if "cannot reach" not in err:
                break
        assert time.monotonic() < deadline and host.poll() is None
    assert ("the job runs --nnodes 1:2 but this launcher --nnodes 1:3; use the same value "
            "everywhere") in err
    assert main(["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                 "--master-port", endpoint.split(":")[1], script]) == 1
    assert ("some launchers of this job were given --node-rank and others not"
            in capsys.readouterr().err)
    (out, err), = _finish([host])
    assert host.returncode == 0, err
    assert out.count("] ran\n") == 1 and "starting with 1 node of --nnodes 1:2" in err


@pytest.mark.parametrize("conf, message", [
    ("join_timeout=abc", "--rdzv-conf join_timeout='abc': expected a number of seconds > 0"),
    ("max_nodes=3", "--rdzv-conf key 'max_nodes' is not one jdist-run knows"),
    ("is_host=maybe", "--rdzv-conf is_host='maybe': expected true or false"),
    ("last_call_timeout", "expected KEY=VALUE,..."),
])
def test_bad_rdzv_conf_is_a_usage_error(conf, message, capsys):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        main(["--nnodes", "1:2", "--rdzv-conf", conf, "s.py"])
    assert info.value.code == 2 and message in capsys.readouterr().err
