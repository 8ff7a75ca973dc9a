"""jdist-run as people use it: a live tqdm bar on a terminal, per-rank log files and
redirects, routine runtime noise hidden, and ``srun ... jdist-run`` with no node flags.

The worker scripts never import JAX, so each launch costs only the launcher's start-up.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jdist.launch._cluster import derived_port
from jdist.launch._config import parse_args
from jdist.launch._relay import Console, Relay

ROOT = str(Path(__file__).resolve().parents[2])


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in ("COLUMNS", "JDIST_AUTH_TOKEN")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


_BAR = """\
    import os, sys, time
    from tqdm import tqdm
    rank = os.environ["RANK"]
    for i in tqdm(range(8), desc="epoch 0", disable=rank != "0", mininterval=0):
        time.sleep(0.1)
    while not os.path.exists(sys.argv[1]):  # hold the epoch open until the test saw it
        time.sleep(0.02)
    print("finished", rank)
"""


def test_a_tqdm_bar_updates_live_on_a_terminal_with_its_rank(tmp_path):
    script = tmp_path / "bar.py"
    script.write_text(textwrap.dedent(_BAR))
    go = tmp_path / "go"
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 90, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "jdist.launch", "--nproc-per-node", "2",
                             str(script), str(go)], env=_env(), stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave)
    os.close(slave)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        # every update arrives while the worker still runs; the bar's close ("\n" after
        # its last redraw) too, before the go: the worker's stdout and stderr are two
        # pipes, so a line printed later may reach the launcher before a redraw
        while re.search(rb"8/8[^\r\n]*\r?\n", seen) is None:
            assert time.monotonic() < deadline and proc.poll() is None, seen[-2000:]
            if select.select([master], [], [], 0.5)[0]:
                seen += os.read(master, 65536)
        assert not go.exists() and proc.poll() is None
        go.write_text("")
        while True:
            try:
                chunk = os.read(master, 65536) if select.select([master], [], [], 5)[0] \
                    else b""
            except OSError:  # the pty closed: the launcher exited
                break
            if not chunk:
                break
            seen += chunk
        assert proc.wait(timeout=30) == 0
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    text = seen.decode("utf-8", "replace").replace("\r\n", "\n")
    redraws = [p for p in text.split("\r") if "epoch 0" in p]
    assert len(redraws) >= 8  # one forwarded update per step, not one line at the end
    for part in redraws:
        assert part.startswith("[rank 0] epoch 0:"), repr(part)
        assert len(part.split("\n")[0]) <= 90  # COLUMNS: the bar fits beside the prefix
    assert "8/8" in redraws[-1]
    assert "[rank 0] finished 0" in text and "[rank 1] finished 1" in text


_NOISY = """\
    import os, sys
    r = os.environ["RANK"]
    print(f"[Gloo] Rank {r} is connected to 1 peer ranks. Expected number of connected "
          f"peer ranks is : 1")
    print(f"W1201 22:17:12.506943   23267 coordination_service.cc:185] [123] Using "
          f"experimental recoverable task feature. The default shutdown barrier will only "
          f"block non-recoverable tasks.", file=sys.stderr)
    print(f"real output {r}")
    print(f"real error {r}", file=sys.stderr)
"""


def test_noise_is_hidden_unless_verbose_and_redirects_pick_streams(tmp_path):
    script = tmp_path / "noisy.py"
    script.write_text(textwrap.dedent(_NOISY))
    logs = tmp_path / "logs"
    res = subprocess.run([sys.executable, "-m", "jdist.launch", "--nproc-per-node", "2",
                          "--log-dir", str(logs), "-r", "3", "-t", "1:3", str(script)],
                         env=_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    # rank 0 redirected (files only), rank 1 teed (files and console), noise hidden
    assert "rank 0]" not in res.stdout + res.stderr
    assert "[rank 1] real output 1" in res.stdout and "[rank 1] real error 1" in res.stderr
    assert "peer ranks" not in res.stdout and "recoverable" not in res.stderr
    for r in range(2):  # one file per rank and stream, with every byte
        d = logs / "attempt_0" / f"rank_{r}"
        out, err = (d / "stdout.log").read_text(), (d / "stderr.log").read_text()
        assert f"real output {r}" in out and f"Rank {r} is connected" in out
        assert f"real error {r}" in err and "recoverable task" in err
    res = subprocess.run([sys.executable, "-m", "jdist.launch", "--nproc-per-node", "2",
                          "--verbose", str(script)], env=_env(), capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    for r in range(2):
        assert f"[rank {r}] [Gloo] Rank {r} is connected to 1 peer ranks" in res.stdout
        assert re.search(rf"\[rank {r}\] W1201 .*recoverable task", res.stderr)


def test_console_keeps_ranks_apart_and_holds_back_partial_noise():
    class Sink:
        def __init__(self):
            self.data = b""

        def write(self, b):
            self.data += b

        def flush(self):
            pass

    out = Sink()
    console = Console(out, out)
    a, b = Relay(b"[rank 0] ", console, 2), Relay(b"[rank 1] ", console, 1)
    a.feed(b"\rbar 1")
    a.flush()
    a.feed(b"\rbar 2")
    a.flush()
    b.feed(b"line from 1\n")  # ends rank 0's open bar line first
    a.feed(b"\rbar 3\n")
    b.feed(b"[Gloo] Rank 1 is conn")  # may be noise: held until the line ends
    b.flush()
    assert b"Gloo" not in out.data
    b.feed(b"ected to 1 peer ranks.\n")
    for cut in range(1, 6):  # a piece that ends inside "[Gloo]" is held as well
        b.feed(b"[Gloo] Rank 1 is connected to 1 peer ranks.\n"[:cut])
        b.flush()
        b.feed(b"[Gloo] Rank 1 is connected to 1 peer ranks.\n"[cut:])
    b.feed(b"x")
    b.close()
    a.feed(b"\rbar 4")  # C++ writes a routine message into the bar's open line
    a.flush()
    a.feed(b"W1201 22:17:12.5 coordination_service.cc:185] Using experimental recoverable")
    a.flush()
    a.feed(b" task feature.\nafter\n")
    assert out.data == (b"\r[rank 0] bar 1\r[rank 0] bar 2\n[rank 1] line from 1\n"
                        b"\r[rank 0] bar 3\n[rank 1] x\n\r[rank 0] bar 4\n[rank 0] after\n")


def _gloo_tokens(rank, peers):
    """gloo's message as its eight writes to stdout (seen with strace)."""
    return [b"[Gloo] Rank ", b"%d" % rank, b" is connected to ", b"%d" % peers,
            b" peer ranks. ", b"Expected number of connected peer ranks is : ",
            b"%d" % peers, b"\n"]


@settings(max_examples=300, deadline=None)
@given(order=st.lists(st.integers(0, 2), min_size=24, max_size=24),
       flushes=st.lists(st.booleans(), min_size=24, max_size=24))
def test_interleaved_gloo_messages_are_hidden_and_nothing_else(order, flushes):
    """A process's device threads print their gloo messages at once, token by token:
    any interleaving is hidden, a live flush between writes included, and the user's
    lines around them (a bare number too) are kept."""
    class Sink:
        data = b""

        def write(self, b):
            self.data += b

        def flush(self):
            pass

    msgs = [_gloo_tokens(r, 3) for r in range(3)]
    out = Sink()
    relay = Relay(b"[rank 0] ", Console(out, out), 1)
    relay.feed(b"before\n")
    for who, flush in zip(order, flushes, strict=True):
        who = next((w for w in (who, 0, 1, 2) if msgs[w]), None)
        relay.feed(msgs[who].pop(0))
        if flush:
            relay.flush()
    relay.feed(b"42\nafter\n")
    relay.close()
    assert out.data == b"[rank 0] before\n[rank 0] 42\n[rank 0] after\n"


_REPORT = """\
    import json, os
    keys = ["RANK", "WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR"]
    print("ENV " + json.dumps({k: os.environ[k] for k in keys}))
"""


def _slurm_env(job, node):
    return _env(SLURM_JOB_ID=job, SLURM_STEP_ID="3", SLURM_PROCID=str(node),
                SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_NODEID=str(node),
                SLURM_STEP_NODELIST="localhost,127.0.0.1",
                SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_NNODES="2")


def test_srun_one_launcher_per_node_needs_no_node_flags(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(textwrap.dedent(_REPORT))
    job = str(os.getpid() * 1000 + int(time.time()) % 1000)
    procs = [subprocess.Popen([sys.executable, "-m", "jdist.launch", "--nproc-per-node", "2",
                               "--rdzv-timeout", "60", str(script)],
                              env=_slurm_env(job, node), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for node in (1, 0)]
    outs = [p.communicate(timeout=90) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    port = derived_port(job, 3, 0)
    assert (f"from SLURM job {job}.3: --nnodes 2 --node-rank 0 --master-addr localhost "
            f"--master-port {port}") in outs[1][1]
    envs = [json.loads(m) for o, _ in outs for m in re.findall(r"ENV (\{.*\})", o)]
    assert sorted(int(e["RANK"]) for e in envs) == [0, 1, 2, 3]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert {(e["RANK"], e["GROUP_RANK"]) for e in envs} == {("0", "0"), ("1", "0"),
                                                            ("2", "1"), ("3", "1")}
    assert {e["MASTER_ADDR"] for e in envs} == {"localhost"}


@pytest.mark.parametrize("argv, env, message", [
    (["--redirects", "3", "s.py"], {}, "--redirects needs --log-dir"),
    (["--log-dir", "d", "--redirects", "4", "s.py"], {}, "--redirects '4': expected 0-3"),
    (["--log-dir", "d", "--tee", "0:x", "s.py"], {}, "--tee '0:x': expected 0-3"),
    (["--rdzv-endpoint", "h:p", "s.py"], {}, "--rdzv-endpoint must be HOST or HOST:PORT"),
    (["--rdzv-endpoint", "h:1", "--master-addr", "x", "s.py"], {}, "not both"),
    (["s.py"], {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
                "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
                "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"},
     "jdist-run runs once per node (srun --ntasks-per-node=1"),
    (["s.py"], {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
                "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_STEP_NODELIST": "n[1-"},
     "cannot read the SLURM step (SLURM_STEP_NODELIST='n[1-'"),
])
def test_bad_launcher_input_is_refused_with_the_value(argv, env, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(argv, env)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_torchrun_spellings():
    cfg = parse_args(["--rdzv-endpoint", "node7:2222", "--nnodes", "2", "--rdzv-backend",
                      "c10d", "--rdzv-id", "job42", "s.py"], {})
    assert (cfg.master_addr, cfg.master_port, cfg.run_id) == ("node7", 2222, "job42")
    cfg = parse_args(["--log-dir", "d", "--tee", "s.py", "--tee"], {})
    assert cfg.script_args == ("--tee",) and cfg.hidden(0) == 0
    cfg = parse_args(["--log-dir", "d", "s.py"], {})
    assert cfg.hidden(0) == 3  # --log-dir alone: files only, as before
    assert parse_args(["--standalone", "s.py"], {}).master_port is None


_ELASTIC = """\
    import json, os, sys, time
    attempt = os.environ["JDIST_RESTART_COUNT"]
    if attempt == "0":
        with open(os.path.join(sys.argv[1], "pid" + os.environ["RANK"]), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
    keys = ["RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "JDIST_RESTART_COUNT",
            "TORCHELASTIC_RESTART_COUNT"]
    print("ENV " + json.dumps({k: os.environ[k] for k in keys}))
"""


def test_nnodes_min_max_goes_on_without_a_lost_node(tmp_path):
    from jdist.store import free_port

    script = tmp_path / "elastic.py"
    script.write_text(textwrap.dedent(_ELASTIC))
    common = ["--nnodes", "2:3", "--nproc-per-node", "1", "--master-port", str(free_port()),
              "--heartbeat-timeout", "2", "--shutdown-timeout", "1", "--rdzv-timeout", "60"]
    procs = [subprocess.Popen([sys.executable, "-m", "jdist.launch", *common, "--node-rank",
                               str(n), str(script), str(tmp_path)], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in (0, 1, 2)]
    files = [tmp_path / f"pid{r}" for r in range(3)]
    deadline = time.monotonic() + 60
    while not all(f.exists() and f.read_text() for f in files):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.05)
    procs[2].kill()  # node 2's launcher vanishes; its worker dies with it
    outs = [p.communicate(timeout=60) for p in procs[:2]]
    procs[2].communicate(timeout=10)
    for p, (_, err) in zip(procs, outs, strict=False):
        assert p.returncode == 0, "\n=====\n".join(e for _, e in outs)
        assert "the launcher of node 2 stopped responding; continuing with 2 nodes" in err
    envs = [json.loads(m) for o, _ in outs for m in re.findall(r"ENV (\{.*\})", o)]
    assert sorted((e["RANK"], e["GROUP_RANK"]) for e in envs) == [("0", "0"), ("1", "1")]
    assert {(e["WORLD_SIZE"], e["GROUP_WORLD_SIZE"]) for e in envs} == {("2", "2")}
    # attempt 2 (JDIST_RESTART_COUNT), but no restart of the budget spent (torch's count)
    assert {(e["JDIST_RESTART_COUNT"], e["TORCHELASTIC_RESTART_COUNT"])
            for e in envs} == {("1", "0")}
    pid2 = int(files[2].read_text())
    assert not os.path.exists(f"/proc/{pid2}") or "Z" in open(f"/proc/{pid2}/stat").read()
