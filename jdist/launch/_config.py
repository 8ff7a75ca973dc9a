"""Command line of ``jdist-run``: flags, defaults and validation (no side effects)."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from typing import NamedTuple

from jdist.launch._cluster import detect_job
from jdist.launch._forkserver import DEFAULT_PRELOAD

__all__ = ["LaunchConfig", "parse_args", "build_parser", "parse_std_spec", "UsageError",
           "parse_min_max_nnodes"]


class UsageError(SystemExit, ValueError):
    """A bad ``jdist-run`` command line (the message names the flag and its value).

    It ends the program with status 2 after the usage line, as argparse's errors do,
    and it is a ``ValueError`` (what ``torch.distributed.run.main`` raises for a bad
    configuration) for code that calls ``jdist.launch.__main__.main`` itself. Fix the
    flag the message names.
    """

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's, raising UsageError
        import sys

        self.print_usage(sys.stderr)
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise UsageError(message)


class LaunchConfig(NamedTuple):
    """Everything the launcher needs, validated."""

    nnodes: int
    node_rank: int | None  # None: ranks follow the order in which launchers join
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
    redirects: dict[int, int] | None = None  # local rank -> streams to files only
    tee_std: dict[int, int] | None = None  # local rank -> streams to files and console
    verbose: bool = False
    run_id: str | None = None
    detected: str = ""  # what was taken from the scheduler (SLURM), for the log
    min_nnodes: int | None = None  # --nnodes MIN:MAX (None: exactly nnodes)
    start_method: str = "spawn"  # "spawn" (fresh interpreters) or "forkserver"
    preload: tuple[str, ...] = DEFAULT_PRELOAD  # what a fork server imports
    compilation_cache: bool = True  # attempts share a JAX compilation cache (restarts)
    last_call_timeout: float = 30.0  # MIN:MAX: wait this long for more once MIN joined
    is_host: bool | None = None  # without --node-rank: host the store (None: if free)
    no_python: bool = False  # run SCRIPT as an executable, not with Python
    exit_barrier_timeout: float = 300.0  # a finished launcher waits this long for peers
    ft: bool = False  # jdist.ft: replicas, the store in the launcher, one replaced at a time

    @property
    def min_nodes(self) -> int:
        """The fewest nodes the job runs with (``nnodes`` unless ``--nnodes MIN:MAX``)."""
        return self.nnodes if self.min_nnodes is None else self.min_nnodes

    def hidden(self, local_rank: int) -> int:
        """Streams of ``local_rank`` kept off the console (bit 1 stdout, 2 stderr)."""
        if self.log_dir is None:
            return 0
        redirect = 3 if self.redirects is None else _bits(self.redirects, local_rank)
        return redirect & ~_bits(self.tee_std or {}, local_rank)


def _bits(spec: Mapping[int, int], local_rank: int) -> int:
    return spec.get(local_rank, spec.get(-1, 0))


def parse_std_spec(value: str, flag: str) -> dict[int, int]:
    """torchrun's stream spec: ``3`` (all ranks) or ``0:1,1:2`` (per local rank).

    Bit 1 is stdout, bit 2 stderr. Key ``-1`` holds the value for every local rank.
    """
    text = value.strip()
    if re.fullmatch(r"[0-3]", text):
        return {-1: int(text)}
    out: dict[int, int] = {}
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*:\s*([0-3])\s*", item)
        if m is None:
            raise ValueError(f"{flag} {value!r}: expected 0-3 (1 stdout, 2 stderr, 3 both) "
                             f"or LOCAL_RANK:0-3 pairs like 0:1,1:2")
        out[int(m.group(1))] = int(m.group(2))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="jdist-run",
        description="Start a jdist job: N processes per node with RANK, WORLD_SIZE, "
                    "MASTER_ADDR/PORT and a per-job JDIST_AUTH_TOKEN set; restart or stop "
                    "them all when one fails.",
        allow_abbrev=False,
    )
    p.add_argument("--nnodes", default=None,
                   help="number of nodes (launchers) in the job, N or MIN:MAX (default 1; "
                        "under srun, the step's node count). With MIN:MAX the job starts "
                        "once MIN nodes joined (waiting 30 s more for the others) and goes "
                        "on with the nodes left when a node's launcher is lost, down to MIN")
    p.add_argument("--node-rank", "--node_rank", type=int, default=None,
                   help="this node's rank in [0, nnodes) (under srun, SLURM_NODEID; "
                        "else 0). Not given with --nnodes MIN:MAX or --rdzv-backend c10d: "
                        "ranks follow the order in which the launchers join, and the "
                        "first launcher to bind --rdzv-endpoint hosts the store "
                        "(torchrun's c10d rendezvous)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", default="1",
                   help="processes to start on this node: a number (default 1), cpu (one "
                        "per CPU core), gpu (one per NVIDIA GPU) or auto (gpu where there "
                        "are GPUs, else cpu)")
    p.add_argument("--master-addr", "--master_addr", default=None,
                   help="address of node 0, which hosts the launchers' store (default "
                        "127.0.0.1; under srun, the first host of the step)")
    p.add_argument("--master-port", "--master_port", type=int, default=None,
                   help="with several nodes, port of the launchers' store (default 29500); "
                        "the workers get another port as MASTER_PORT, chosen by the store's "
                        "host. On one node, the workers' MASTER_PORT (default: a free port)")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None,
                   help="HOST[:PORT] of the launchers' store, as torchrun spells "
                        "--master-addr/--master-port (port default 29400)")
    p.add_argument("--rdzv-backend", "--rdzv_backend", default="static",
                   choices=["static", "c10d"],
                   help="both use jdist's store; without --node-rank, c10d (like "
                        "--nnodes MIN:MAX) hands node ranks out in join order, static "
                        "means node 0 (torchrun's defaults)")
    p.add_argument("--rdzv-conf", "--rdzv_conf", default="",
                   help="torchrun's KEY=VALUE,... rendezvous settings: join_timeout (or "
                        "timeout; as --rdzv-timeout), last_call_timeout (seconds to wait for "
                        "more nodes once MIN joined, default 30), keep_alive_interval x "
                        "keep_alive_max_attempt (as --heartbeat-timeout), is_host "
                        "(true/false: whether this launcher hosts the store); close_timeout "
                        "and read_timeout are accepted and have no effect")
    p.add_argument("--monitor-interval", "--monitor_interval", type=float, default=0.1,
                   help="accepted for torchrun compatibility (must be > 0): jdist-run "
                        "checks its workers every 50 ms")
    p.add_argument("--no-python", "--no_python", action="store_true",
                   help="run SCRIPT as an executable (a shell script, a binary) instead "
                        "of with Python; not with -m")
    p.add_argument("--run-path", "--run_path", action="store_true",
                   help="accepted for torchrun compatibility: workers always run SCRIPT "
                        "with runpy.run_path in their interpreter")
    p.add_argument("--rdzv-id", "--rdzv_id", default=None,
                   help="job id given to the workers (JDIST_RUN_ID, TORCHELASTIC_RUN_ID; "
                        "default: a random id per job)")
    p.add_argument("--standalone", action="store_true",
                   help="single-node job on free ports (implies --nnodes 1 --node-rank 0)")
    p.add_argument("--devices-per-proc", "--devices_per_proc", type=int, default=None,
                   help="virtual CPU devices per process (sets XLA_FLAGS "
                        "--xla_force_host_platform_device_count in each child)")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                   help="restarts of the whole job after a failure, counted for the whole "
                        "job across nodes (default 0)")
    p.add_argument("--shutdown-timeout", "--shutdown_timeout", "--grace", type=float,
                   default=None, dest="shutdown_timeout",
                   help="seconds between SIGTERM and SIGKILL when workers are stopped "
                        "(default: $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 5)")
    p.add_argument("--exit-barrier-timeout", "--exit_barrier_timeout", type=float,
                   default=None,
                   help="with several nodes: seconds a launcher whose workers finished "
                        "waits for the other nodes' workers to finish before it leaves "
                        "with success (torch's exit barrier; the launcher hosting the "
                        "store waits for every live node, as leaving would stop their "
                        "job). Default: $TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT, else 300")
    p.add_argument("--rdzv-timeout", type=float, default=300.0,
                   help="seconds the launchers wait for each other (default 300)")
    p.add_argument("--heartbeat-timeout", type=float, default=30.0,
                   help="with several nodes: seconds without a heartbeat from another "
                        "node's launcher before the job is stopped (default 30)")
    p.add_argument("--log-dir", "--log_dir", default=None,
                   help="write each rank's stdout/stderr to LOG_DIR/attempt_K/rank_N/"
                        "{stdout,stderr}.log (the console then shows them only with --tee)")
    p.add_argument("-r", "--redirects", "--redirect", default=None,
                   help="with --log-dir, streams kept off the console: 0 none, 1 stdout, "
                        "2 stderr, 3 both (the default with --log-dir), or per local rank "
                        "like 0:1,1:2 (torchrun's spelling)")
    p.add_argument("-t", "--tee", nargs="?", const="3", default=None,
                   help="with --log-dir, streams also shown on the console (same values as "
                        "--redirects; plain --tee means 3)")
    p.add_argument("--verbose", action="store_true",
                   help="show the runtime's routine messages too (gloo's 'Rank N is "
                        "connected to N peer ranks', the coordination service's "
                        "'recoverable task' warning); hidden by default")
    p.add_argument("--start-method", "--start_method", default=None,
                   choices=["spawn", "fork", "forkserver"],
                   help="how workers start: spawn, a fresh interpreter each (the default; "
                        "fork is taken as spawn), or forkserver, forked from a server that "
                        "imported the --forkserver-preload modules once, so a worker and "
                        "each restart skip seconds of imports. Default: "
                        "$JDIST_START_METHOD, else spawn")
    p.add_argument("--forkserver-preload", default=None, metavar="MODULES",
                   help="with --start-method forkserver: comma-separated modules the server "
                        "imports (default: $JDIST_FORKSERVER_PRELOAD, else "
                        f"{','.join(DEFAULT_PRELOAD)}); none may create a JAX array")
    p.add_argument("--no-compilation-cache", dest="compilation_cache", action="store_false",
                   help="turn off JAX's persistent compilation cache: by default one "
                        "directory per user and host ($XDG_CACHE_HOME or ~/.cache, then "
                        "jdist/jax-compilation-cache/<host>), shared by every rank and "
                        "every re-run; with restarts, a per-job directory removed at the "
                        "end; JAX_COMPILATION_CACHE_DIR, if set, is used instead")
    p.add_argument("--ft", action="store_true",
                   help="run each worker as a jdist.ft replica: the launcher hosts their "
                        "store and replaces a worker that dies (up to --max-restarts) "
                        "while the others keep training")
    p.add_argument("-m", "--module", action="store_true",
                   help="run SCRIPT as a module (python -m SCRIPT)")
    p.add_argument("script", help="the Python script (or module with -m) to run")
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="arguments for the script")
    return p


def _tee_value(argv: list[str]) -> list[str]:
    """``--tee`` followed by the script (not a stream spec) means ``--tee 3``."""
    out = list(argv)
    for i, word in enumerate(out):
        if word in ("--tee", "-t") and i + 1 < len(out) and not (
                out[i + 1].isdigit() or ":" in out[i + 1]):  # a spec, valid or not
            out.insert(i + 1, "3")
            break
        if not word.startswith("-") and (i == 0 or out[i - 1] not in _VALUE_FLAGS):
            break  # the script: the rest is the script's
    return out


_VALUE_FLAGS = {"--nnodes", "--node-rank", "--node_rank", "--nproc-per-node",
                "--nproc_per_node", "--master-addr", "--master_addr", "--master-port",
                "--master_port", "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-backend",
                "--rdzv_backend", "--rdzv-id", "--rdzv_id", "--devices-per-proc",
                "--devices_per_proc", "--max-restarts", "--max_restarts",
                "--shutdown-timeout", "--shutdown_timeout", "--grace", "--exit-barrier-timeout",
                "--exit_barrier_timeout", "--rdzv-timeout", "--heartbeat-timeout",
                "--log-dir", "--log_dir", "-r", "--redirects", "--redirect", "--tee", "-t",
                "--start-method", "--start_method", "--forkserver-preload", "--rdzv-conf",
                "--rdzv_conf", "--monitor-interval", "--monitor_interval"}


def _from_slurm(a, p, environ: Mapping[str, str]) -> str:
    """Fill --nnodes/--node-rank/--master-addr/--master-port from an srun step."""
    if a.nnodes is not None and a.node_rank is not None and a.master_addr is not None:
        return ""
    try:
        job = detect_job(environ)
    except ValueError as e:
        if "SLURM" not in str(e):
            return ""
        p.error(f"cannot read the SLURM step ({e}); pass --nnodes, --node-rank and "
                f"--master-addr")
    if job.source != "slurm":
        return ""
    if job.local_world_size != 1:
        p.error(f"under srun, jdist-run runs once per node (srun --ntasks-per-node=1 "
                f"jdist-run --nproc-per-node P ...); this step has {job.local_world_size} "
                f"tasks on node {job.node_rank}")
    taken = []
    if a.nnodes is None:
        a.nnodes = job.nnodes
        taken.append(f"--nnodes {job.nnodes}")
    if a.node_rank is None:
        a.node_rank = job.node_rank
        taken.append(f"--node-rank {job.node_rank}")
    if a.master_addr is None:
        a.master_addr = job.master_addr
        taken.append(f"--master-addr {job.master_addr}")
    if a.master_port is None and a.nnodes > 1:
        a.master_port = job.master_port
        taken.append(f"--master-port {job.master_port}")
    return f"from SLURM job {job.job_id}: {' '.join(taken)}" if taken else ""


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def parse_min_max_nnodes(nnodes: str) -> tuple[int, int]:
    """``--nnodes``'s value as ``(MIN, MAX)``: ``"4"`` -> (4, 4), ``"2:20"`` -> (2, 20)
    (torch.distributed.run's helper of this name). Anything else raises torch's
    ``RuntimeError``."""
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(nnodes))
    if m is None:
        raise RuntimeError(f'nnodes={nnodes} is not in "MIN:MAX" format; give N or MIN:MAX, '
                           f'like 1:4')
    return int(m.group(1)), int(m.group(2) or m.group(1))


def _env_defaults(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """torchrun's ``PET_<FLAG>`` variables (``PET_NPROC_PER_NODE=4``, ``PET_MODULE=1``):
    a flag's value where the command line does not give it."""
    for action in p._actions:
        name = "PET_" + action.dest.upper()
        if not action.option_strings or action.dest == "help" or name not in environ:
            continue
        value = environ[name]
        if action.nargs == 0:  # an on/off flag: 1 means given
            word = value.strip().lower()
            if word not in _TRUE + _FALSE:
                p.error(f"{name}={value!r}: expected 1 (as if {action.option_strings[0]} "
                        f"were given) or 0")
            p.set_defaults(**{action.dest: action.const if word in _TRUE else action.default})
        else:  # argparse converts a string default with the flag's type
            p.set_defaults(**{action.dest: value})


RDZV_CONF_KEYS = ("join_timeout", "timeout", "last_call_timeout", "keep_alive_interval",
                  "keep_alive_max_attempt", "is_host", "close_timeout", "read_timeout")


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """torchrun's ``--rdzv-conf`` (``KEY=VALUE,...``, quotes around it or a value
    dropped) as a dict; a key jdist-run does not know raises ``ValueError``."""
    out: dict[str, str] = {}
    body = text.strip().strip("'\"").strip()
    for item in body.split(",") if body else []:
        key, sep, value = item.partition("=")
        key, value = key.strip().strip("'\""), value.strip().strip("'\"")
        if not key or not sep:
            raise ValueError(f"--rdzv-conf {text!r}: expected KEY=VALUE,... like "
                             f"join_timeout=600,last_call_timeout=30")
        if key not in RDZV_CONF_KEYS:
            raise ValueError(f"--rdzv-conf key {key!r} is not one jdist-run knows; use "
                             f"{', '.join(RDZV_CONF_KEYS)}")
        out[key] = value
    return out


def _seconds(conf: dict[str, str], key: str) -> float | None:
    if key not in conf:
        return None
    try:
        value = float(conf[key])
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"--rdzv-conf {key}={conf[key]!r}: expected a number of seconds > 0")
    return value


def _apply_rdzv_conf(a, conf: dict[str, str]) -> None:
    """Fold ``--rdzv-conf``'s keys into the flags they stand for."""
    join = _seconds(conf, "join_timeout") or _seconds(conf, "timeout")
    if join is not None:
        a.rdzv_timeout = join
    a.last_call_timeout = _seconds(conf, "last_call_timeout") or 30.0
    interval = _seconds(conf, "keep_alive_interval")
    attempts = _seconds(conf, "keep_alive_max_attempt")
    if interval is not None or attempts is not None:
        a.heartbeat_timeout = (interval or 5.0) * (attempts or 3.0)  # torch's 5 s x 3
    for key in ("close_timeout", "read_timeout"):
        _seconds(conf, key)  # checked; jdist-run has no such phase
    a.is_host = None
    if "is_host" in conf:
        word = conf["is_host"].lower()
        if word not in _TRUE + _FALSE or not word:
            raise ValueError(f"--rdzv-conf is_host={conf['is_host']!r}: expected true or "
                             f"false")
        a.is_host = word in _TRUE


def local_gpu_count(environ: Mapping[str, str]) -> int:
    """NVIDIA GPUs this node's processes may use (``/dev/nvidiaN``, narrowed by
    ``CUDA_VISIBLE_DEVICES``), found without importing JAX."""
    import glob

    found = len([d for d in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", d)])
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return found
    ids = []
    for word in visible.split(","):
        if not word.strip() or word.strip() == "-1":
            break  # CUDA stops at the first invalid entry
        ids.append(word)
    return min(len(ids), found)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def resolve_nproc(value: str, environ: Mapping[str, str]) -> int:
    """``--nproc-per-node``: a number, ``cpu``, ``gpu`` or ``auto`` (torchrun's values);
    ``ValueError`` with torch's words for one that cannot be met."""
    text = str(value).strip()
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if text == "cpu":
        return _cpu_count()
    if text in ("gpu", "cuda"):
        n = local_gpu_count(environ)
        if n == 0:
            raise ValueError("Cuda is not available.: --nproc-per-node gpu found no NVIDIA "
                             "GPU (/dev/nvidiaN, CUDA_VISIBLE_DEVICES); give a number")
        return n
    if text == "xpu":
        raise ValueError("Xpu is not available.: jdist runs on JAX, which has no XPU "
                         "backend; give a number")
    if text == "auto":
        return local_gpu_count(environ) or _cpu_count()
    raise ValueError(f"Unsupported nproc_per_node value: {value}; give a number, cpu, gpu "
                     f"or auto")


def parse_args(argv: list[str] | None = None,
               environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """Parse and validate ``argv`` (``sys.argv[1:]`` when None).

    Under an ``srun`` step (``environ``, default ``os.environ``), ``--nnodes``,
    ``--node-rank``, ``--master-addr`` and ``--master-port`` that are not given come
    from SLURM. torchrun's ``PET_<FLAG>`` variables (``PET_NPROC_PER_NODE=4``,
    ``PET_NO_PYTHON=1``) stand for flags the command line does not give.
    Exits with a usage message (status 2) on bad flags, as argparse does.
    """
    import sys

    env = os.environ if environ is None else environ
    p = build_parser()
    _env_defaults(p, env)
    a = p.parse_args(_tee_value(sys.argv[1:] if argv is None else argv))
    try:
        a.nproc_per_node = resolve_nproc(a.nproc_per_node, env)
        _apply_rdzv_conf(a, parse_rdzv_conf(a.rdzv_conf))
    except ValueError as e:
        p.error(str(e))
    if a.no_python and a.module:
        p.error("Don't use both the '--no-python' flag and the '--module' flag at the same "
                "time: --no-python runs SCRIPT as an executable, -m as a Python module")
    if a.run_path:  # torchrun: --run-path wins over --no-python
        a.no_python = False
    if a.monitor_interval <= 0:
        p.error(f"--monitor-interval must be > 0 seconds, got {a.monitor_interval}")
    if a.rdzv_endpoint is not None:
        host, _, port = a.rdzv_endpoint.rpartition(":") if ":" in a.rdzv_endpoint else (
            a.rdzv_endpoint, "", "29400")
        if not host or not port.isdigit():
            p.error(f"--rdzv-endpoint must be HOST or HOST:PORT, got {a.rdzv_endpoint!r}")
        if a.master_addr is not None or a.master_port is not None:
            p.error("give --rdzv-endpoint or --master-addr/--master-port, not both")
        a.master_addr, a.master_port = host, int(port)
    min_nnodes = None
    if a.nnodes is not None:
        try:
            low, high = parse_min_max_nnodes(a.nnodes)
        except RuntimeError:
            p.error(f"--nnodes must be N or MIN:MAX, got {a.nnodes!r}")
        if ":" in a.nnodes:
            min_nnodes = low
        a.nnodes = high
        if min_nnodes is not None:
            if not 1 <= min_nnodes <= a.nnodes:
                p.error(f"--nnodes MIN:MAX needs 1 <= MIN <= MAX, got "
                        f"{min_nnodes}:{a.nnodes}")
    detected = "" if a.standalone else _from_slurm(a, p, env)
    a.nnodes = 1 if a.nnodes is None else a.nnodes
    if a.node_rank is None and (a.nnodes == 1 or a.standalone or (
            a.rdzv_backend == "static" and min_nnodes is None)):
        a.node_rank = 0  # (torchrun's static default); else the rendezvous hands them out
    a.master_addr = "127.0.0.1" if a.master_addr is None else a.master_addr
    redirects = tee = None
    try:
        if a.redirects is not None:
            redirects = parse_std_spec(a.redirects, "--redirects")
        if a.tee is not None:
            tee = parse_std_spec(a.tee, "--tee")
    except ValueError as e:
        p.error(str(e))
    if a.standalone:
        if a.nnodes != 1 or a.node_rank != 0:
            p.error(f"--standalone runs one node; got --nnodes {a.nnodes} "
                    f"--node-rank {a.node_rank}")
        a.master_port = None
    if a.nnodes < 1:
        p.error(f"--nnodes must be >= 1, got {a.nnodes}")
    if a.node_rank is not None and not 0 <= a.node_rank < a.nnodes:
        p.error(f"--node-rank must be in [0, {a.nnodes}), got {a.node_rank}")
    if a.nproc_per_node < 1:
        p.error(f"--nproc-per-node must be >= 1, got {a.nproc_per_node}")
    if a.devices_per_proc is not None and a.devices_per_proc < 1:
        p.error(f"--devices-per-proc must be >= 1, got {a.devices_per_proc}")
    if a.max_restarts < 0:
        p.error(f"--max-restarts must be >= 0, got {a.max_restarts}")
    for flag, variable, default in _TIMEOUTS:
        _timeout_from_env(p, a, flag, variable, default, env)
    if a.rdzv_timeout <= 0:
        p.error(f"--rdzv-timeout must be > 0 seconds, got {a.rdzv_timeout}")
    if a.heartbeat_timeout <= 0:
        p.error(f"--heartbeat-timeout must be > 0 seconds, got {a.heartbeat_timeout}")
    port = a.master_port
    if port is not None and not 1 <= port <= 65535:
        p.error(f"--master-port must be in [1, 65535], got {port}")
    if port is None and a.nnodes > 1:
        port = 29500
    if tee is not None and a.log_dir is None:
        p.error("--tee needs --log-dir (without it the output goes to the console anyway)")
    if redirects is not None and a.log_dir is None:
        p.error("--redirects needs --log-dir DIR (where the redirected streams go)")
    start_method = a.start_method or env.get("JDIST_START_METHOD") or "spawn"
    if start_method not in ("spawn", "fork", "forkserver"):
        p.error(f"JDIST_START_METHOD must be spawn, fork or forkserver, got "
                f"{start_method!r}")
    start_method = "spawn" if start_method == "fork" else start_method
    spec = a.forkserver_preload
    if spec is None:
        spec = env.get("JDIST_FORKSERVER_PRELOAD") or ",".join(DEFAULT_PRELOAD)
    preload = tuple(m.strip() for m in spec.split(","))
    if not all(re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", m) for m in preload):
        p.error(f"--forkserver-preload / JDIST_FORKSERVER_PRELOAD must be comma-separated "
                f"module names like jax,flax.nnx, got {spec!r}")
    return LaunchConfig(
        nnodes=a.nnodes, node_rank=a.node_rank, nproc_per_node=a.nproc_per_node,
        master_addr=a.master_addr, master_port=port, devices_per_proc=a.devices_per_proc,
        max_restarts=a.max_restarts, shutdown_timeout=a.shutdown_timeout,
        rdzv_timeout=a.rdzv_timeout, heartbeat_timeout=a.heartbeat_timeout,
        log_dir=a.log_dir, tee=tee is not None, module=a.module,
        script=a.script, script_args=tuple(a.script_args), redirects=redirects,
        tee_std=tee, verbose=a.verbose, run_id=a.rdzv_id, detected=detected,
        min_nnodes=min_nnodes, start_method=start_method, preload=preload,
        compilation_cache=a.compilation_cache, last_call_timeout=a.last_call_timeout,
        is_host=a.is_host, no_python=a.no_python,
        exit_barrier_timeout=a.exit_barrier_timeout, ft=a.ft,
    )


# flag, torch's variable that stands for it, jdist-run's default
_TIMEOUTS = (("--shutdown-timeout", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 5.0),
             ("--exit-barrier-timeout", "TORCH_ELASTIC_EXIT_BARRIER_TIMEOUT", 300.0))


def _timeout_from_env(p: argparse.ArgumentParser, a, flag: str, variable: str,
                      default: float, environ: Mapping[str, str]) -> None:
    """A timeout flag's value: the flag, else torch's ``variable``, else ``default``;
    negative is refused with torch's words (``shutdown_timeout must be non-negative``)."""
    dest = flag.lstrip("-").replace("-", "_")
    value, origin = getattr(a, dest), flag
    if value is None and environ.get(variable, "").strip():
        origin = variable
        try:
            value = float(environ[variable])
        except ValueError:
            p.error(f"{variable}={environ[variable]!r}: expected a number of seconds >= 0 "
                    f"(it stands for {flag})")
    value = default if value is None else value
    if value < 0:
        p.error(f"{origin}: {dest} must be non-negative, got {value:g}; give a number of "
                f"seconds >= 0")
    setattr(a, dest, value)
