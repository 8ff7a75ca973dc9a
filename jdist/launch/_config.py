"""Command line of ``jdist-run``: flags, defaults and validation (no side effects)."""

from __future__ import annotations

import argparse
from typing import NamedTuple

__all__ = ["LaunchConfig", "parse_args", "build_parser"]


class LaunchConfig(NamedTuple):
    """Everything the launcher needs, validated."""

    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int | None  # None: a free port (single-node only)
    devices_per_proc: int | None
    max_restarts: int
    shutdown_timeout: float
    rdzv_timeout: float
    heartbeat_timeout: float
    log_dir: str | None
    tee: bool
    module: bool
    script: str
    script_args: tuple[str, ...]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jdist-run",
        description="Start a jdist job: N processes per node with RANK, WORLD_SIZE, "
                    "MASTER_ADDR/PORT and a per-job JDIST_AUTH_TOKEN set; restart or stop "
                    "them all when one fails.",
        allow_abbrev=False,
    )
    p.add_argument("--nnodes", type=int, default=1,
                   help="number of nodes (launchers) in the job (default 1)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=0,
                   help="this node's rank in [0, nnodes) (default 0)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1,
                   help="processes to start on this node (default 1)")
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1",
                   help="address of node 0, which hosts the launchers' store (default "
                        "127.0.0.1)")
    p.add_argument("--master-port", "--master_port", type=int, default=None,
                   help="port of the launchers' store on node 0 (default: a free port on "
                        "one node, 29500 with several). The workers get another port as "
                        "MASTER_PORT, chosen by node 0")
    p.add_argument("--standalone", action="store_true",
                   help="single-node job on free ports (implies --nnodes 1 --node-rank 0)")
    p.add_argument("--devices-per-proc", "--devices_per_proc", type=int, default=None,
                   help="virtual CPU devices per process (sets XLA_FLAGS "
                        "--xla_force_host_platform_device_count in each child)")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                   help="restarts of the whole job after a failure, counted for the whole "
                        "job across nodes (default 0)")
    p.add_argument("--shutdown-timeout", "--grace", type=float, default=5.0,
                   dest="shutdown_timeout",
                   help="seconds between SIGTERM and SIGKILL when workers are stopped "
                        "(default 5)")
    p.add_argument("--rdzv-timeout", type=float, default=300.0,
                   help="seconds the launchers wait for each other (default 300)")
    p.add_argument("--heartbeat-timeout", type=float, default=30.0,
                   help="with several nodes: seconds without a heartbeat from another "
                        "node's launcher before the job is stopped (default 30)")
    p.add_argument("--log-dir", "--log_dir", default=None,
                   help="write each rank's stdout/stderr to LOG_DIR/attempt_K/rank_N/"
                        "{stdout,stderr}.log (the console then shows them only with --tee)")
    p.add_argument("--tee", action="store_true",
                   help="with --log-dir, also show the output on the console")
    p.add_argument("-m", "--module", action="store_true",
                   help="run SCRIPT as a module (python -m SCRIPT)")
    p.add_argument("script", help="the Python script (or module with -m) to run")
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="arguments for the script")
    return p


def parse_args(argv: list[str] | None = None) -> LaunchConfig:
    """Parse and validate ``argv`` (``sys.argv[1:]`` when None).

    Exits with a usage message (status 2) on bad flags, as argparse does.
    """
    p = build_parser()
    a = p.parse_args(argv)
    if a.standalone:
        if a.nnodes != 1 or a.node_rank != 0:
            p.error(f"--standalone runs one node; got --nnodes {a.nnodes} "
                    f"--node-rank {a.node_rank}")
        a.master_port = None
    if a.nnodes < 1:
        p.error(f"--nnodes must be >= 1, got {a.nnodes}")
    if not 0 <= a.node_rank < a.nnodes:
        p.error(f"--node-rank must be in [0, {a.nnodes}), got {a.node_rank}")
    if a.nproc_per_node < 1:
        p.error(f"--nproc-per-node must be >= 1, got {a.nproc_per_node}")
    if a.devices_per_proc is not None and a.devices_per_proc < 1:
        p.error(f"--devices-per-proc must be >= 1, got {a.devices_per_proc}")
    if a.max_restarts < 0:
        p.error(f"--max-restarts must be >= 0, got {a.max_restarts}")
    if a.shutdown_timeout < 0:
        p.error(f"--shutdown-timeout must be >= 0 seconds, got {a.shutdown_timeout}")
    if a.rdzv_timeout <= 0:
        p.error(f"--rdzv-timeout must be > 0 seconds, got {a.rdzv_timeout}")
    if a.heartbeat_timeout <= 0:
        p.error(f"--heartbeat-timeout must be > 0 seconds, got {a.heartbeat_timeout}")
    port = a.master_port
    if port is not None and not 1 <= port <= 65535:
        p.error(f"--master-port must be in [1, 65535], got {port}")
    if port is None and a.nnodes > 1:
        port = 29500
    if a.tee and a.log_dir is None:
        p.error("--tee needs --log-dir (without it the output goes to the console anyway)")
    return LaunchConfig(
        nnodes=a.nnodes, node_rank=a.node_rank, nproc_per_node=a.nproc_per_node,
        master_addr=a.master_addr, master_port=port, devices_per_proc=a.devices_per_proc,
        max_restarts=a.max_restarts, shutdown_timeout=a.shutdown_timeout,
        rdzv_timeout=a.rdzv_timeout, heartbeat_timeout=a.heartbeat_timeout,
        log_dir=a.log_dir, tee=a.tee, module=a.module,
        script=a.script, script_args=tuple(a.script_args),
    )
