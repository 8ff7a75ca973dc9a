"""TCPStore set+get round trip: jdist against torch.distributed.TCPStore, same run.

Two set-ups, each timed for both stores on loopback:

- ``in-process``: the client is the master store object itself (rank 0's view; the
  server thread shares the process, and for jdist the GIL, with the client);
- ``server process``: the server runs in a separate process and this process is a
  plain client (every other rank's view).

One sample is ``store.set(key, 16 bytes); store.get(key)``. Samples of the two stores
are interleaved in blocks so that load on the machine hits both alike; each number is
the median over all samples. The goal is ``jdist / torch <= 1.5``.

    PYTHONPATH=. python benchmarks/store.py            # 20 blocks x 500 samples
    PYTHONPATH=. python benchmarks/store.py --smoke    # 3 blocks x 100 samples

The last line, ``BENCH_JSON {...}``, holds the same numbers for benchmarks/run_all.py.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
TOKEN = "benchmark-token"
VALUE = b"x" * 16


def _serve(kind: str, port: int) -> None:
    """Child process: host a master store on ``port`` until stdin closes."""
    if kind == "jdist":
        from jdist.collectives import TCPStore

        store = TCPStore("127.0.0.1", port, is_master=True, auth_token=TOKEN)
    else:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=60),
                              wait_for_workers=False)
    print("ready", flush=True)
    sys.stdin.read()
    del store


def _jdist_client(port: int | None):
    from jdist.collectives import TCPStore

    if port is None:
        return TCPStore("127.0.0.1", 0, is_master=True, auth_token=TOKEN)
    return TCPStore("127.0.0.1", port, timeout=30, auth_token=TOKEN)


def _torch_client(port: int | None):
    import torch.distributed as dist

    if port is None:
        return dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=60))
    return dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))


def _samples(store, n: int) -> list[float]:
    out = []
    perf = time.perf_counter
    for _ in range(n):
        t = perf()
        store.set("bench", VALUE)
        store.get("bench")
        out.append(perf() - t)
    return out


def _measure(stores: dict, blocks: int, per_block: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in stores}
    for s in stores.values():  # warm-up
        _samples(s, 50)
    for _ in range(blocks):
        for name, s in stores.items():
            time.sleep(0.3)  # let the scheduler forget the other store's load (see below)
            times[name] += _samples(s, per_block)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def _server_process(kind: str):
    from jdist.launch import free_port

    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, str(port)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise RuntimeError(f"{kind} store server did not start (said {line!r})")
    return proc, port


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", "--quick", action="store_true", help="few samples (a quick check)")
    p.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve:
        _serve(a.serve[0], int(a.serve[1]))
        return
    blocks, per_block = (3, 100) if a.smoke else (20, 500)
    rows = []
    in_proc = _measure({"jdist": _jdist_client(None), "torch": _torch_client(None)},
                       blocks, per_block)
    rows.append(("in-process", in_proc))
    servers = [_server_process("jdist"), _server_process("torch")]
    try:
        remote = _measure({"jdist": _jdist_client(servers[0][1]),
                           "torch": _torch_client(servers[1][1])}, blocks, per_block)
        rows.append(("server process", remote))
    finally:
        for proc, _ in servers:
            proc.stdin.close()
            proc.wait(10)
    print(f"TCPStore set+get round trip, median of {blocks * per_block} samples "
          f"(16-byte value, loopback)")
    print(f"{'set-up':<16}{'jdist us':>10}{'torch us':>10}{'ratio':>8}  goal <= 1.5")
    for name, r in rows:
        ratio = r["jdist"] / r["torch"]
        print(f"{name:<16}{r['jdist']:>10.1f}{r['torch']:>10.1f}{ratio:>8.2f}  "
              f"{'ok' if ratio <= 1.5 else 'over'}")
    from benchmarks._parse import bench_json, row, table

    print(bench_json("store", [table(
        f"TCPStore set+get round trip, median of {blocks * per_block} samples", "torch",
        "jdist / torch (lower is better)",
        [row(name, "us", r["jdist"], r["torch"], r["jdist"] / r["torch"], "goal <= 1.5")
         for name, r in rows])]))


if __name__ == "__main__":
    main()
