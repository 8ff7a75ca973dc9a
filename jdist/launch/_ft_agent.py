"""``jdist-run --ft``: one replica per worker, the store in the launcher, one worker
replaced at a time.

Without ``--ft`` a failed worker ends the attempt and every worker restarts. With it,
each worker is a replica group of its own (``jdist.ft``): the launcher hosts the
TCPStore the replicas agree through (``JDIST_FT_STORE``), so no worker - rank 0
included - holds anything the others need, and when a worker dies the launcher starts
a replacement with the same RANK (``JDIST_FT_INCARNATION`` one higher) while the others
keep running. ``--max-restarts`` counts replacements. One node only, for now.
"""

from __future__ import annotations

import os
import secrets
import sys
import time

from jdist.launch._config import LaunchConfig
from jdist.launch._env import JobInfo, worker_env
from jdist.launch._forkserver import worker_launch
from jdist.launch._relay import binary_stream
from jdist.launch._rendezvous import say
from jdist.launch._worker_group import WorkerGroup, describe_exit, exit_code_of
from jdist.store import TCPStore, free_port

__all__ = ["run_ft"]

_POLL_S = 0.05


class _Replicas:
    """The current worker of each rank, and how many times each was started."""

    def __init__(self, cfg: LaunchConfig, environ: dict[str, str], store: TCPStore):
        self.cfg, self.environ = cfg, environ
        self.token = environ.get("JDIST_AUTH_TOKEN") or secrets.token_hex(16)
        self.run_id = cfg.run_id or secrets.token_hex(8)
        self.store_spec = f"{cfg.master_addr}:{store.port}"
        self.groups: dict[int, WorkerGroup] = {}
        self.incarnation = {r: 0 for r in range(cfg.nproc_per_node)}
        self.spent = 0

    def start(self, rank: int) -> None:
        cfg, n = self.cfg, self.cfg.nproc_per_node
        job = JobInfo(n, 0, 1, 0, n, cfg.master_addr, free_port(), self.token, self.run_id,
                      self.incarnation[rank], cfg.max_restarts, restarts_spent=self.spent)
        env = worker_env(self.environ, job, rank, cfg.devices_per_proc,
                         compilation_cache=cfg.compilation_cache)
        env.update(JDIST_FT_STORE=self.store_spec,
                   JDIST_FT_INCARNATION=str(self.incarnation[rank]))
        argv, start = worker_launch(os.getpid(), cfg.script, cfg.script_args, cfg.module,
                                    cfg.no_python, cfg.start_method, cfg.preload)
        log_dir = None
        if cfg.log_dir is not None:
            log_dir = os.path.join(cfg.log_dir, f"incarnation_{self.incarnation[rank]}")
        self.groups[rank] = WorkerGroup([(rank, rank, argv, env)], binary_stream(sys.stdout),
                                        binary_stream(sys.stderr), log_dir, cfg.hidden,
                                        cfg.verbose, start)

    def stop(self) -> None:
        for group in self.groups.values():
            group.stop(self.cfg.shutdown_timeout)


def _watch(reps: _Replicas) -> int:
    """Replace failed workers while the budget lasts; the job's exit code."""
    done: dict[int, int] = {}
    while len(done) < len(reps.groups):
        time.sleep(_POLL_S)
        for rank, group in reps.groups.items():
            if rank in done:
                continue
            code = group.workers[0].proc.poll()
            if code is None:
                continue
            if code == 0:
                done[rank] = 0
            elif reps.spent < reps.cfg.max_restarts and 0 not in done.values():
                reps.spent += 1
                reps.incarnation[rank] += 1
                say(f"rank {rank} {describe_exit(code)}; starting a replacement (replacement "
                    f"{reps.spent} of --max-restarts {reps.cfg.max_restarts}); the other "
                    f"replicas go on")
                reps.start(rank)
            else:
                done[rank] = exit_code_of(code)
                say(f"rank {rank} {describe_exit(code)}; no replacement "
                    f"({'the job is ending' if 0 in done.values() else 'restart budget spent'})")
    bad = [c for c in done.values() if c]
    return bad[0] if bad else 0


def run_ft(cfg: LaunchConfig, environ: dict[str, str]) -> int:
    """Run ``cfg``'s workers as ``jdist.ft`` replicas on this node."""
    if cfg.nnodes != 1 or cfg.min_nnodes is not None:
        say(f"error: --ft runs on one node (got --nnodes {cfg.nnodes}); start one "
            f"jdist-run --ft per node with its own replicas, or use --max-restarts")
        return 2
    token = environ.get("JDIST_AUTH_TOKEN") or secrets.token_hex(16)
    environ = {**environ, "JDIST_AUTH_TOKEN": token}
    store = TCPStore(cfg.master_addr, 0, is_master=True, auth_token=token,
                     wait_for_workers=False)
    reps = _Replicas(cfg, environ, store)
    try:
        for rank in range(cfg.nproc_per_node):
            reps.start(rank)
        code = _watch(reps)
    except KeyboardInterrupt:
        say("got SIGINT; stopped every worker")
        code = 130
    finally:
        reps.stop()
        store.close()
    if code:
        say(f"the job failed (exit code {code})")
    return code
