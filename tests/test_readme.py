"""README's quick start runs as written, in one process and under jdist-run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers import COMPILE_FLAG

ROOT = Path(__file__).resolve().parents[1]


def _quick_start(tmp_path: Path) -> Path:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README has no python block"
    script = tmp_path / "quick_start.py"
    script.write_text(blocks[0])
    return script


def _env(devices: int) -> dict:
    env = dict(os.environ)
    # the README's command as a user runs it: jdist-run's default start, not the suite's
    env.pop("JDIST_START_METHOD", None)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} {COMPILE_FLAG}"
    env["PYTHONPATH"] = str(ROOT)
    return env


def test_quick_start_single_process(tmp_path):
    out = subprocess.run([sys.executable, str(_quick_start(tmp_path))], env=_env(2),
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split()[-1]) > 0.0


def test_quick_start_under_launcher_gives_same_loss(tmp_path):
    script = _quick_start(tmp_path)
    single = subprocess.run([sys.executable, str(script)], env=_env(1),
                            capture_output=True, text=True, timeout=240)
    assert single.returncode == 0, single.stderr[-3000:]
    env = _env(1)
    env["XLA_FLAGS"] = COMPILE_FLAG  # one device per process
    multi = subprocess.run(
        [sys.executable, "-m", "jdist.launch", "--nproc-per-node", "2", str(script)],
        env=env, capture_output=True, text=True, timeout=240)
    assert multi.returncode == 0, multi.stdout[-3000:] + multi.stderr[-3000:]
    losses = {m.group(1): float(m.group(2)) for m in
              re.finditer(r"^\[rank (\d)\] (-?[0-9.]+(?:e[-+]?\d+)?)$", multi.stdout, re.M)}
    # every process feeds the same 8 rows, so the global mean loss equals the
    # single-process loss on those rows
    assert len(losses) == 2, multi.stdout[-2000:]
    for v in losses.values():
        assert abs(v - float(single.stdout.split()[-1])) < 1e-5
