"""jdist.rpc against torch.distributed.rpc (TensorPipe) and a raw socket, same run.

Two processes on loopback for each system (``jdist.launch.spawn``); rank 0 measures:

- latency: median wall time of ``rpc_sync("w1", echo, (16 float32,))`` (a no-op that
  returns its small array argument); goal: jdist <= torch;
- throughput: a 64 MiB float32 array echoed (sent and returned) by ``rpc_sync``;
  bytes moved (2 x 64 MiB) / median round-trip time; goal: jdist >= torch and
  >= 50% of a raw Python socket doing the same echo (``sendall`` + ``recv_into``).

The raw socket is of the kind jdist's two local workers talk over: an abstract Unix
socket on Linux (``jdist.rpc.transport._tcp.LOCAL_SOCKETS``), TCP on loopback elsewhere.

Each system runs in its own pair of processes, one after the other, in rounds
(jdist, torch, raw, jdist, ...); each number is the best round's. CPU time of both
processes per operation is printed too: on a busy machine it is the steadier measure.

    PYTHONPATH=. python benchmarks/rpc.py           # 2 rounds, 2000 calls, 10 echoes
    PYTHONPATH=. python benchmarks/rpc.py --smoke   # 1 round, 200 calls, 3 echoes

The last line, ``BENCH_JSON {...}``, holds the same numbers for benchmarks/run_all.py.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
MIB = 1 << 20


def echo(x):
    return x


def _measure(call, small, big, n_lat: int, n_tp: int, peer_cpu) -> tuple:
    """(median latency, bytes/s, CPU s per small call, CPU s per big echo); CPU of both."""
    for _ in range(50):
        call(small)
    lat = []
    c0, p0 = time.process_time(), peer_cpu()
    for _ in range(n_lat):
        t0 = time.perf_counter()
        call(small)
        lat.append(time.perf_counter() - t0)
    cpu_small = (time.process_time() - c0 + peer_cpu() - p0) / n_lat
    call(big)
    tp = []
    c0, p0 = time.process_time(), peer_cpu()
    for _ in range(n_tp):
        t0 = time.perf_counter()
        out = call(big)
        tp.append(time.perf_counter() - t0)
        assert out.shape == big.shape
    cpu_big = (time.process_time() - c0 + peer_cpu() - p0) / n_tp
    nbytes = 2 * big.nbytes
    return statistics.median(lat), nbytes / statistics.median(tp), cpu_small, cpu_big


def bench_jdist(n_lat: int, n_tp: int, size: int):
    import numpy as np

    from jdist import rpc

    rank = int(os.environ["RANK"])
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2,
                 rpc_backend_options=rpc.RpcBackendOptions(rpc_timeout=120))
    res = None
    if rank == 0:
        res = _measure(lambda x: rpc.rpc_sync("w1", echo, (x,)), np.ones(16, np.float32),
                       np.ones(size // 4, np.float32), n_lat, n_tp,
                       lambda: rpc.rpc_sync("w1", time.process_time))
    rpc.shutdown()
    return res


def bench_torch(n_lat: int, n_tp: int, size: int):
    import torch
    import torch.distributed.rpc as trpc

    rank = int(os.environ["RANK"])
    opts = trpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=120)
    trpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    res = None
    if rank == 0:
        res = _measure(lambda x: trpc.rpc_sync("w1", echo, (x,)), torch.ones(16),
                       torch.ones(size // 4), n_lat, n_tp,
                       lambda: trpc.rpc_sync("w1", time.process_time))
    trpc.shutdown()
    return res


def _recv_exact(sock: socket.socket, buf) -> None:
    view, got = memoryview(buf), 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def _tune_raw(sock: socket.socket) -> None:
    """What jdist's transport sets on the same kind of socket."""
    if sock.family == socket.AF_UNIX:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    else:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def bench_raw(n_lat: int, n_tp: int, size: int):
    """Rank 1 echoes length-prefixed messages; rank 0 measures like the RPC runs."""
    import numpy as np

    from jdist.rpc.transport._tcp import LOCAL_SOCKETS

    rank = int(os.environ["RANK"])
    port = int(os.environ["MASTER_PORT"])
    unix_name = f"\0jdist-bench-raw-{port}"
    if rank == 1:
        if LOCAL_SOCKETS:
            srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            srv.bind(unix_name)
            srv.listen(1)
        else:
            srv = socket.create_server(("127.0.0.1", port))
        conn, _ = srv.accept()
        _tune_raw(conn)
        head = bytearray(8)
        while True:
            try:
                _recv_exact(conn, head)
            except ConnectionError:
                return None
            size = int.from_bytes(head, "big")
            if size == 0:  # CPU-time query
                conn.sendall(int(time.process_time() * 1e9).to_bytes(8, "big"))
                continue
            # fresh numpy memory (lazily mapped, huge pages), as jdist's receiver uses:
            # bytearray(size) would zero-fill 4 KiB pages and double the echo time
            body = np.empty(size, np.uint8)
            _recv_exact(conn, body)
            conn.sendall(head)
            conn.sendall(body)
    deadline = time.monotonic() + 30
    while True:
        try:
            if LOCAL_SOCKETS:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(unix_name)
            else:
                sock = socket.create_connection(("127.0.0.1", port))
            break
        except (ConnectionRefusedError, FileNotFoundError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    _tune_raw(sock)

    def call(arr):
        data = memoryview(arr).cast("B")
        sock.sendall(len(data).to_bytes(8, "big"))
        sock.sendall(data)
        head = bytearray(8)
        _recv_exact(sock, head)
        out = np.empty_like(arr)
        _recv_exact(sock, memoryview(out).cast("B"))
        return out

    def peer_cpu():
        sock.sendall((0).to_bytes(8, "big"))
        out = bytearray(8)
        _recv_exact(sock, out)
        return int.from_bytes(out, "big") / 1e9

    res = _measure(call, np.ones(16, np.float32), np.ones(size // 4, np.float32), n_lat, n_tp,
                   peer_cpu)
    sock.close()
    return res


def main(argv=None) -> None:
    from jdist.launch import spawn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", "--quick", action="store_true", help="tiny run (CI)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--echoes", type=int, default=10)
    p.add_argument("--mib", type=int, default=64)
    a = p.parse_args(argv)
    if a.smoke:
        a.rounds, a.calls, a.echoes = 1, 200, 3
    args = (a.calls, a.echoes, a.mib * MIB)
    env = {"OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu"}
    runs: dict[str, list[tuple]] = {"jdist": [], "torch": [], "raw": []}
    for _ in range(a.rounds):
        for name, fn in (("jdist", bench_jdist), ("torch", bench_torch), ("raw", bench_raw)):
            runs[name].append(spawn(fn, args=args, nprocs=2, timeout=600, env=env)[0])
    best = {n: (min(r[0] for r in rs), max(r[1] for r in rs), min(r[2] for r in rs),
                min(r[3] for r in rs)) for n, rs in runs.items()}
    print(f"rpc_sync echo of 16 float32 (median of {a.calls}, best of {a.rounds} rounds); "
          "CPU = both processes:")
    for name in ("jdist", "torch", "raw"):
        print(f"  {name:6s} latency {best[name][0] * 1e6:8.1f} us   "
              f"CPU {best[name][2] * 1e6:8.1f} us/call")
    print(f"echo of a {a.mib} MiB float32 array (bytes moved / median round trip):")
    for name in ("jdist", "torch", "raw"):
        print(f"  {name:6s} {best[name][1] / 1e9:8.2f} GB/s   "
              f"CPU {best[name][3] * 1e3:8.1f} ms/echo")
    j, t, r = best["jdist"], best["torch"], best["raw"]
    print(f"latency    jdist/torch = {j[0] / t[0]:.2f}  (goal <= 1); "
          f"CPU per call jdist/torch = {j[2] / t[2]:.2f}")
    print(f"throughput jdist/torch = {j[1] / t[1]:.2f}  (goal >= 1); "
          f"CPU per echo jdist/torch = {j[3] / t[3]:.2f}")
    from jdist.rpc.transport._tcp import LOCAL_SOCKETS

    kind = "abstract Unix socket" if LOCAL_SOCKETS else "TCP on loopback"
    print(f"raw: a plain Python {kind}, as jdist's local peers use")
    print(f"throughput jdist/raw socket = {j[1] / r[1]:.2f}  (goal >= 0.5); "
          f"CPU per echo jdist/raw = {j[3] / r[3]:.2f}")
    from benchmarks._parse import bench_json, row, table

    small, big = "latency, 16 float32 echo", f"throughput, {a.mib} MiB echo"
    print(bench_json("rpc", [
        table("rpc_sync vs torch.distributed.rpc (TensorPipe)", "torch",
              "jdist / torch (latency, CPU: lower is better; throughput: higher is better)", [
                  row(small, "us", j[0] * 1e6, t[0] * 1e6, j[0] / t[0], "goal <= 1"),
                  row("CPU per call (both processes)", "us", j[2] * 1e6, t[2] * 1e6,
                      j[2] / t[2]),
                  row(big, "GB/s", j[1] / 1e9, t[1] / 1e9, j[1] / t[1], "goal >= 1"),
                  row("CPU per echo (both processes)", "ms", j[3] * 1e3, t[3] * 1e3,
                      j[3] / t[3])]),
        table(f"rpc_sync vs a raw Python socket ({kind})", "raw socket", "jdist / raw socket", [
            row(small, "us", j[0] * 1e6, r[0] * 1e6),
            row(big, "GB/s", j[1] / 1e9, r[1] / 1e9, j[1] / r[1], "goal >= 0.5"),
            row("CPU per echo (both processes)", "ms", j[3] * 1e3, r[3] * 1e3, j[3] / r[3])])],
        {"rpc": {"latency_us": {n: best[n][0] * 1e6 for n in best},
                 "throughput_GBps": {n: best[n][1] / 1e9 for n in best}}}))

if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    import benchmarks.rpc as _self  # so spawned workers can import the bench functions

    _self.main()
