"""The torch twins' results, recorded: a port's torch run is an oracle whose answer
depends only on torch's version, the twin's sources and its inputs, so it is run once,
stored under ``tests/examples/torch_results/`` and read back by later runs (each twin
launch costs torch's imports in every rank: about half of test_ports.py's CPU time).

The key hashes torch's and Python's versions, the twin script with its shared modules
(``_common.py``, ``_data.py``), the launch shape and the arguments, where a file
argument counts by its content (an ``.npz`` by its arrays) and the values of the flags
that only name places (``--out``, ports, ``--snapshot-path``) do not count. Any change
to any of them runs torch again. ``JDIST_TORCH_RERUN=1`` runs every twin and checks the
record against the fresh result (then rewrites it).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import torch

from examples.ports._run import HERE, run_both, run_one

STORE = Path(__file__).resolve().parent / "torch_results"
PLACES = {"--out", "--master-port", "--pg-port", "--rpc-port", "--snapshot-path"}
# result fields no test compares: step times, and the pipeline's BatchNorm running
# means (its micro-batches reach a shard concurrently: the update order varies, in
# torch too)
UNCOMPARED = {"times", "means"}


def _file_digest(path: str) -> bytes:
    if path.endswith(".npz"):  # np.savez stamps the time into the zip: hash the arrays
        h = hashlib.sha256()
        with np.load(path) as z:
            for k in z.files:
                h.update(k.encode() + z[k].tobytes() + str(z[k].dtype).encode())
        return h.digest()
    return hashlib.sha256(Path(path).read_bytes()).digest()


def key(name: str, nproc: int, args: list[str], launch: tuple) -> str:
    h = hashlib.sha256()
    h.update(f"{torch.__version__}|{sys.version_info[:2]}|{np.__version__}".encode())
    for f in (f"{name}_torch.py", "_common.py", "_data.py"):
        h.update(f.encode() + (Path(HERE) / f).read_bytes())
    skip = False
    for a in args:
        if skip:
            skip = False
            h.update(b"<place>")
        elif a in PLACES:
            skip = True
            h.update(a.encode())
        elif os.path.isfile(a):
            h.update(_file_digest(a))
        else:
            h.update(a.encode())
    h.update(repr((nproc, launch)).encode())
    return f"{name}-{h.hexdigest()[:20]}"


def run_both_cached(name: str, nproc: int, args, *, timeout: float, tmp: str,
                    launcher_args=(), relaunch_torch: bool = False,
                    spawn: bool = False) -> tuple[dict, dict]:
    """``run_both``'s ``(jdist results, torch results)``, torch's from the record when
    there is one (then only the jdist side runs)."""
    def args_of(lib):
        out = os.path.join(tmp, lib)
        return list(args(lib, out)) if callable(args) else list(args)

    path = STORE / (key(name, nproc, args_of("torch"),
                        (tuple(launcher_args), relaunch_torch, spawn)) + ".pkl")
    rerun = os.environ.get("JDIST_TORCH_RERUN", "") not in ("", "0")
    if path.exists() and not rerun:
        with open(path, "rb") as f:
            theirs = pickle.load(f)
        mine = run_one("jdist", name, nproc, args_of("jdist"), timeout=timeout,
                       launcher_args=launcher_args, spawn=spawn,
                       tmp=os.path.join(tmp, "jdist"))
        return mine, theirs
    mine, theirs = run_both(name, nproc, args, timeout=timeout, tmp=tmp,
                            launcher_args=launcher_args, relaunch_torch=relaunch_torch,
                            spawn=spawn)
    record = {k: v for k, v in theirs.items() if isinstance(k, int)}
    if path.exists():  # JDIST_TORCH_RERUN: the record must be what torch gives now
        with open(path, "rb") as f:
            old = pickle.load(f)
        _assert_same(old, record, path.name)
    STORE.mkdir(exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(record, f, protocol=4)
    return mine, theirs


def _assert_same(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(map(str, a)) == sorted(map(str, b)), where
        for k in a:
            if k not in UNCOMPARED:
                _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, (np.ndarray, float, np.floating)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=where)
    else:
        assert a == b, (where, a, b)
