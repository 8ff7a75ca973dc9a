"""examples/train_ddp_torch_loader.py under jdist-run (2 processes x 2 devices, 2 loader
workers each): torch's order per rank, the checkpoint state, one loss on both ranks.

(That batches placed by the loader train exactly like host batches is checked once, on a
small model, in test_arrays.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DistributedSampler as TorchSampler

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_ddp_torch_loader.py"


@pytest.mark.slow(seconds=16)
def test_example_under_jdist_run_feeds_torchs_order(tmp_path):
    cmd = [sys.executable, "-m", "jdist.launch", "--standalone", "--nproc-per-node", "2",
           "--devices-per-proc", "2", str(EXAMPLE), "--smoke", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, res in enumerate(results):
        assert (res["rank"], res["world"], res["per_process"]) == (rank, 2, 32)
        theirs = TorchSampler(range(1500), 2, rank, shuffle=True, seed=0, drop_last=True)
        want = []
        for epoch in (0, 1):  # smoke: 3 steps per epoch
            theirs.set_epoch(epoch)
            order = list(theirs)
            want += [order[i * 32:(i + 1) * 32] for i in range(3)]
        assert res["batches"] == want
        assert (res["state"]["epoch"], res["state"]["consumed"]) == (1, 96)
    # DDP's loss is the mean over all replicas: the same number on both ranks
    assert results[0]["losses"] == results[1]["losses"]
    assert all(np.isfinite(results[0]["losses"])) and len(results[0]["losses"]) == 6
    assert results[0]["accuracy"] == results[1]["accuracy"]

