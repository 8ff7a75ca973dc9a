"""The per-node agent of ``jdist-run``: rendezvous of the launchers, attempts, restarts.

Launchers agree through a store. With one node it is an in-process
:class:`~jdist.collectives.HashStore`; with several, node 0 hosts a
:class:`~jdist.collectives.TCPStore` at ``--master-addr:--master-port`` and the other
launchers connect to it (it is authenticated when ``JDIST_AUTH_TOKEN`` is set in the
launchers' environment, and runs without a secret otherwise). Keys, under the prefix
``jdist-run/``:

- ``node/<i>/claim`` (a node rank may be used once), ``node/<i>/nproc``;
- ``job/token``, ``job/run_id``, ``job/max_restarts`` (node 0's values win);
- ``round/<r>/port``: the workers' MASTER_PORT of attempt ``r``, a free port that node 0
  picks for each attempt. It differs from the launchers' store port, so the job's
  processes run their own rendezvous (``init_process_group``) undisturbed;
- ``round/<r>/failed``: the first failure of attempt ``r``: the earliest by its time
  (``_blame``: a rank's recorded exception or fatal signal, not the order in which
  launchers noticed exits), kept by a ``compare_set`` loop, so every node reports the
  same rank; the other nodes poll it, add an earlier failure of their own, and stop
  their workers;
- ``round/<r>/done`` / ``round/<r>/stopped``: counters of nodes whose workers
  finished / were stopped; a new attempt starts when every node stopped the last one;
- ``hb/<i>``: a counter each launcher bumps every second from a thread with its own
  connection; a launcher whose counter stands still for ``--heartbeat-timeout`` is
  declared gone (its workers died with it: they get SIGKILL when their launcher dies),
  and the job stops without restart;
- ``job/abort`` (a launcher got SIGINT/SIGTERM or went silent: no restart),
  ``job/exited``.

The restart budget ``--max-restarts`` counts attempts of the whole job (torch counts
it per agent, pytorch#108158). A job that may restart gives its attempts one JAX
compilation cache (a per-job temporary directory on each node, removed at the end;
``_env.restart_cache_env``), so a restarted attempt loads what its predecessor compiled.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time

from jdist.errors import StoreError, StoreTimeoutError
from jdist.launch._blame import candidate, error_file_env, first_failure, reply_to_parent
from jdist.launch._config import LaunchConfig
from jdist.launch._env import (
    JobInfo,
    has_user_cache,
    restart_cache_env,
    worker_args,
    worker_command,
    worker_env,
)
from jdist.launch._forkserver import forkserver_script
from jdist.launch._stop import signal_group
from jdist.launch._worker_group import (
    Failure,
    Worker,
    WorkerGroup,
    describe_exit,
    exit_code_of,
)
from jdist.store import HashStore, PrefixStore, Store, TCPStore, free_port

__all__ = ["run", "LaunchError"]

_POLL_S = 0.05
_REMOTE_POLL_S = 0.2
_BEAT_S = 1.0
_LAST_CALL_S = 30.0  # --nnodes MIN:MAX: wait this long for more nodes once MIN joined


class LaunchError(RuntimeError):
    """The launchers could not form or run the job (not a worker failure)."""


class _Terminated(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _say(msg: str) -> None:
    sys.stderr.write(f"jdist-run: {msg}\n")
    sys.stderr.flush()


class _Agent:
    def __init__(self, cfg: LaunchConfig, environ: dict[str, str]):
        self.cfg = cfg
        self.environ = environ
        self.group: WorkerGroup | None = None
        env_token = environ.get("JDIST_AUTH_TOKEN") or None
        self.env_token = env_token
        self.store: Store = PrefixStore("jdist-run", self._open_store(env_token))
        self.round = 0
        self.silent_node: int | None = None
        self.members: list[int] = list(range(cfg.nnodes))  # node ranks of this attempt
        self.lock = threading.Lock()
        self._stop_beats = threading.Event()
        # the workers' failure records (``_blame``), one folder per attempt
        self.error_dir = tempfile.mkdtemp(prefix="jdist-run-errors-")

    # --- heartbeats ----------------------------------------------------------------------
    def start_heartbeats(self) -> None:
        """Beat, and watch the other launchers' beats, from a daemon thread."""
        if self.cfg.nnodes > 1:
            threading.Thread(target=self._beat_loop, args=(self.store.clone(),), daemon=True,
                             name="jdist-run-heartbeat").start()

    def _beat_loop(self, store: Store) -> None:
        cfg = self.cfg
        seen: dict[int, tuple[int, float]] = {}
        dead: set[int] = set()
        try:
            while not self._stop_beats.wait(_BEAT_S):
                store.add(f"hb/{cfg.node_rank}", 1)
                now = time.monotonic()
                with self.lock:
                    members = list(self.members)
                for i in members:
                    if i == cfg.node_rank or i in dead:
                        continue
                    count = store.add(f"hb/{i}", 0)
                    if count != seen.get(i, (-1, now))[0]:
                        seen[i] = (count, now)
                    elif now - seen[i][1] > cfg.heartbeat_timeout:
                        dead.add(i)
                        self.silent_node = i
                        if store.add(f"node/{i}/reported", 1) > 1:
                            continue  # another launcher reported it (maybe a round ago)
                        how = (f"stopped: the launcher of node {i} stopped responding (no "
                               f"heartbeat for {now - seen[i][1]:.0f}s)")
                        blob = json.dumps(Failure(-1, -1, i, 1, how, "", self.round)._asdict())
                        store.set(f"node/{i}/dead", "1")
                        alive = len([m for m in members if m not in dead])
                        if alive < cfg.min_nodes:
                            store.set("job/abort", "1")
                        store.compare_set(f"round/{self.round}/failed", "", blob)
                        if alive < cfg.min_nodes:
                            return
        except (StoreError, OSError):
            return  # the store host is gone; the main loop finds out by itself
        finally:
            close = getattr(store, "close", None)
            if close is not None:
                close()

    def stop_heartbeats(self) -> None:
        self._stop_beats.set()

    def _open_store(self, token: str | None) -> Store:
        cfg = self.cfg
        if cfg.nnodes == 1:
            return HashStore(timeout=cfg.rdzv_timeout)
        kw = dict(timeout=cfg.rdzv_timeout, auth_token=token)
        try:
            if cfg.node_rank == 0:
                return TCPStore(cfg.master_addr, cfg.master_port, is_master=True,
                                wait_for_workers=False, **kw)
            return TCPStore(cfg.master_addr, cfg.master_port, **kw)
        except OSError as e:
            raise LaunchError(f"node {cfg.node_rank} cannot reach the launchers' store at "
                              f"{cfg.master_addr}:{cfg.master_port}: {e}") from e

    # --- rendezvous ----------------------------------------------------------------------
    def rendezvous(self) -> tuple[list[int], str, str, int]:
        cfg, s = self.cfg, self.store
        if s.add(f"node/{cfg.node_rank}/claim", 1) > 1:
            raise LaunchError(f"--node-rank {cfg.node_rank} is used by two launchers; give "
                              f"each launcher its own node rank in [0, {cfg.nnodes})")
        s.set(f"node/{cfg.node_rank}/nproc", str(cfg.nproc_per_node))
        if cfg.node_rank == 0:
            token = self.env_token or secrets.token_hex(16)
            s.multi_set(["job/token", "job/run_id", "job/max_restarts", "job/nnodes"],
                        [token, cfg.run_id or secrets.token_hex(8), str(cfg.max_restarts),
                     str(cfg.nnodes)])
        if cfg.node_rank == 0:
            s.set("round/0/members", json.dumps(self._gather()))
        try:
            s.wait(["job/token", "round/0/members"], cfg.rdzv_timeout)
        except StoreTimeoutError:
            raise LaunchError(f"node 0 did not start the job within --rdzv-timeout "
                              f"{cfg.rdzv_timeout:g}s") from None
        nnodes0 = int(s.get("job/nnodes"))
        if nnodes0 != cfg.nnodes:
            raise LaunchError(f"node 0 runs --nnodes {nnodes0} but this launcher "
                              f"--nnodes {cfg.nnodes}; use the same value everywhere")
        members = json.loads(s.get("round/0/members"))
        if cfg.node_rank not in members:
            raise LaunchError(f"node {cfg.node_rank} joined after the job started with nodes "
                              f"{members} (--nnodes {cfg.min_nodes}:{cfg.nnodes}); start it "
                              f"within the rendezvous, or restart the job")
        keys = [f"node/{i}/nproc" for i in range(cfg.nnodes)]
        nprocs = [int(s.get(k)) if s.check([k]) else 0 for k in keys]
        token, run_id, max_restarts = (v.decode() for v in
                                       s.multi_get(["job/token", "job/run_id",
                                                    "job/max_restarts"]))
        if int(max_restarts) != cfg.max_restarts:
            _say(f"node 0 runs --max-restarts {max_restarts}; using it instead of "
                 f"{cfg.max_restarts}")
        return nprocs, token, run_id, int(max_restarts)

    def _gather(self) -> list[int]:
        """Node 0: the node ranks that joined (all of them, or at least ``min_nodes``
        and whoever else arrives within the last call)."""
        cfg, s = self.cfg, self.store
        deadline = time.monotonic() + cfg.rdzv_timeout
        last_call = None
        while True:
            joined = [i for i in range(cfg.nnodes) if s.check([f"node/{i}/nproc"])]
            now = time.monotonic()
            if len(joined) == cfg.nnodes:
                return joined
            if len(joined) >= cfg.min_nodes:
                last_call = last_call or now + min(_LAST_CALL_S, cfg.rdzv_timeout)
                if now > last_call:
                    _say(f"starting with nodes {joined} of --nnodes "
                         f"{cfg.min_nodes}:{cfg.nnodes}")
                    return joined
            if now > deadline:
                missing = [i for i in range(cfg.nnodes) if i not in joined]
                raise LaunchError(
                    f"node ranks {missing} did not join within --rdzv-timeout "
                    f"{cfg.rdzv_timeout:g}s; start one launcher per node rank with the same "
                    f"--nnodes/--master-addr/--master-port")
            time.sleep(_POLL_S)

    def live(self) -> list[int]:
        """This attempt's nodes that are not known to be gone."""
        with self.lock:
            members = list(self.members)
        return [i for i in members if not self.store.check([f"node/{i}/dead"])]

    # --- one attempt ---------------------------------------------------------------------
    def start(self, job: JobInfo) -> WorkerGroup:
        cfg = self.cfg
        argv = worker_command(os.getpid(), cfg.script, cfg.script_args, cfg.module)
        columns = None
        if sys.stderr.isatty():
            columns = shutil.get_terminal_size().columns - len(f"[rank {job.world_size}] ")
        errors = os.path.join(self.error_dir, f"attempt_{job.restart_count}")
        os.makedirs(errors, exist_ok=True)
        cmds = []
        for lr in range(cfg.nproc_per_node):
            env = worker_env(self.environ, job, lr, cfg.devices_per_proc, columns,
                             compilation_cache=cfg.compilation_cache)
            env.update(error_file_env(os.path.join(errors, f"rank_{job.rank_offset + lr}.json")))
            cmds.append((job.rank_offset + lr, lr, argv, env))
        log_dir = None
        if cfg.log_dir is not None:
            log_dir = os.path.join(cfg.log_dir, f"attempt_{job.restart_count}")
        start = None
        if cfg.start_method == "forkserver":
            tail = worker_args(cfg.script, cfg.script_args, cfg.module)

            def start(_argv, env):
                return forkserver_script(tail, env, cfg.preload)

        self.group = WorkerGroup(cmds, sys.stdout.buffer, sys.stderr.buffer, log_dir,
                                 cfg.hidden, cfg.verbose, start)
        return self.group

    def watch(self, group: WorkerGroup, r: int) -> Failure | None:
        """Wait for the attempt to end; the first failure (local or remote) or None."""
        cfg, s = self.cfg, self.store
        failed_key = f"round/{r}/failed"
        last_remote = time.monotonic()
        while True:
            failed, running = group.poll()
            if failed:
                mine = _first_on_node(group, cfg.node_rank, r)  # before any signal
                for other in group.workers:  # end the others at once
                    if other.proc.poll() is None:
                        signal_group(other.proc.pid, signal.SIGTERM)
                first = _report_earliest(s, failed_key, mine)
                group.stop(cfg.shutdown_timeout)
                return first
            if not running:
                break
            if cfg.nnodes > 1 and time.monotonic() - last_remote >= _REMOTE_POLL_S:
                last_remote = time.monotonic()
                if s.check([failed_key]):  # a rank here may have failed before it
                    mine = _first_on_node(group, cfg.node_rank, r)
                    first = Failure(**json.loads(s.get(failed_key)))
                    if mine is not None:
                        first = _report_earliest(s, failed_key, mine)
                    group.stop(cfg.shutdown_timeout)
                    return first
            time.sleep(_POLL_S)
        group.stop(0.0)  # every worker exited 0; reap stragglers in their groups
        s.add(f"round/{r}/done", 1)
        while True:  # wait for the other nodes: they may still fail
            if s.check([failed_key]):
                return Failure(**json.loads(s.get(failed_key)))
            if s.add(f"round/{r}/done", 0) >= len(self.live()):
                return None
            time.sleep(_REMOTE_POLL_S)

    def sync_stop(self, r: int) -> None:
        """Wait until every node stopped its workers of attempt ``r``."""
        cfg, s = self.cfg, self.store
        s.add(f"round/{r}/stopped", 1)
        deadline = time.monotonic() + cfg.rdzv_timeout
        while s.add(f"round/{r}/stopped", 0) < len(live := self.live()):
            if len(live) < cfg.min_nodes:
                raise LaunchError(f"the launcher of node {self.silent_node} stopped "
                                  f"responding; cannot restart without it")
            if time.monotonic() > deadline:
                raise LaunchError(f"not every node stopped its workers of attempt {r + 1} "
                                  f"within {cfg.rdzv_timeout:g}s")
            time.sleep(_POLL_S)

    def finish(self) -> None:
        """Say goodbye; node 0 keeps its store up until the others left (or 10 s)."""
        try:
            self.store.add("job/exited", 1)
            if self.cfg.node_rank == 0 and self.cfg.nnodes > 1:  # (lost nodes are not waited for)
                deadline = time.monotonic() + 10.0
                while (self.store.add("job/exited", 0) < len(self.live())
                       and time.monotonic() < deadline):
                    time.sleep(_POLL_S)
        except StoreError:
            pass


def _first_on_node(group: WorkerGroup, node_rank: int, r: int) -> Failure | None:
    """This node's earliest failure of attempt ``r`` (``_blame.first_failure``): a
    recorded exception or fatal signal counts by its time, so a rank that raised first
    is named even while it is still shutting down and its peers already died."""
    found: dict[int, Worker] = {w.rank: w for w in group.workers}
    cands = [c for w in group.workers
             if (c := candidate(w.rank, w.error_file, w.proc.returncode, w.seen_alive,
                                describe_exit)) is not None]
    if not cands:
        return None
    first, later = first_failure(cands)
    w = found[first.rank]
    code = first.exit_code
    if code is None:
        code = exit_code_of(w.proc.returncode)
    after = "; ".join(f"rank {c.rank} {_clip(c.how)}" for c in later)
    tail = w.stderr_tail(0.5 if w.proc.returncode is not None else 0.0)  # (still going:
    return Failure(w.rank, w.local_rank, node_rank, code, first.how, tail, r,  # no wait)
                   first.time, first.traceback, after)


def _report_earliest(store: Store, key: str, mine: Failure | None) -> Failure:
    """Keep the earlier of ``mine`` and the failure stored at ``key`` there (a
    ``compare_set`` loop, so nodes that report at once agree); return the stored one."""
    if mine is None:
        return Failure(**json.loads(store.get(key)))
    blob = json.dumps(mine._asdict())
    current = store.compare_set(key, "", blob).decode()
    while current != blob:
        theirs = Failure(**json.loads(current))
        if (theirs.time, theirs.rank) <= (mine.time, mine.rank) or not mine.time:
            return theirs
        current = store.compare_set(key, current, blob).decode()
    return mine


def _clip(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _indent(text: str, limit: int = 40) -> str:
    lines = text.rstrip("\n").splitlines()[-limit:]
    return "".join(f"    {line}\n" for line in lines) or "    (empty)\n"


def _summary(f: Failure, attempts: int, max_restarts: int) -> str:
    head = (f"rank {f.rank} (node {f.node_rank}, local rank {f.local_rank}) {f.how} "
            f"on attempt {f.attempt + 1} of {attempts}"
            if f.rank >= 0 else f"{f.how} on attempt {f.attempt + 1} of {attempts}")
    if f.rank < 0:
        return f"job failed: {head}."
    text = f"job failed: {head}; no restarts left (--max-restarts {max_restarts})."
    if f.traceback:  # a recorded exception, or the stack at a fatal signal
        text += f" Its Python traceback:\n{_indent(f.traceback)}"
    if not f.traceback or not f.how.startswith("raised "):  # a signal: the runtime's words
        text += f"{'' if f.traceback else ' '}Last lines of its stderr:\n"
        text += _indent(f.stderr_tail)
    if f.later:
        text += f"Failed after it (consequences, in time order): {f.later}\n"
    return text.rstrip("\n")


def run(cfg: LaunchConfig, environ: dict[str, str] | None = None) -> int:
    """Run the job described by ``cfg`` on this node; return the launcher's exit code."""
    environ = dict(os.environ if environ is None else environ)
    state = {"raised": False}

    def on_signal(signum, frame):
        if not state["raised"]:
            state["raised"] = True
            raise _Terminated(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, on_signal)
    agent = None
    cache = None  # the attempts' compilation cache (a restarted attempt reuses it)
    r = 0
    if not cfg.module and not os.path.isfile(cfg.script):
        _say(f"error: script {cfg.script!r} not found (working directory {os.getcwd()!r}); "
             f"pass a path to a Python file, or -m for a module")
        return 2
    if cfg.detected:
        _say(cfg.detected)
    try:
        agent = _Agent(cfg, environ)
        nprocs, token, run_id, max_restarts = agent.rendezvous()
        if (cfg.compilation_cache and (max_restarts > 0 or cfg.min_nnodes is not None)
                and not has_user_cache(environ)):
            cache = tempfile.mkdtemp(prefix=f"jdist-run-{run_id[:16]}-jax-cache-")
            environ.update(restart_cache_env(environ, cache))  # agent.environ too
        s = agent.store
        agent.start_heartbeats()
        used = 0  # restarts spent on failures (a lost node of MIN:MAX spends none)
        while True:
            if cfg.node_rank == 0:
                if r > 0:
                    s.set(f"round/{r}/members", json.dumps(agent.live()))
                s.set(f"round/{r}/port", str(free_port(cfg.master_addr)))
            port = int(s.get(f"round/{r}/port"))
            members = json.loads(s.get(f"round/{r}/members"))
            with agent.lock:
                agent.members = members
            agent.round = r
            mine = members.index(cfg.node_rank)
            job = JobInfo(sum(nprocs[i] for i in members),
                          sum(nprocs[i] for i in members[:mine]), len(members), mine,
                          cfg.nproc_per_node, cfg.master_addr, port, token, run_id, r,
                          max_restarts)
            failure = agent.watch(agent.start(job), r)
            agent.group = None
            if failure is None:
                agent.finish()
                return 0
            lost = [i for i in members if i not in agent.live()]
            if lost and failure.rank < 0 and not s.check(["job/abort"]):
                left = len(members) - len(lost)
                _say(f"the launcher of node {', '.join(map(str, lost))} stopped responding; "
                     f"continuing with {left} nodes (--nnodes {cfg.min_nodes}:{cfg.nnodes}), "
                     f"attempt {r + 2}")
                agent.sync_stop(r)
                r += 1
                continue
            if used < max_restarts and not s.check(["job/abort"]):
                used += 1
                who = f"rank {failure.rank}" if failure.rank >= 0 else "a launcher"
                _say(f"{who} {failure.how}; restarting the job (attempt {r + 2} of "
                     f"{max_restarts + 1 + r + 1 - used})")
                agent.sync_stop(r)
                r += 1
                continue
            if cfg.nnodes > 1 and s.check([f"round/{r}/failed"]):  # another node's may
                failure = Failure(**json.loads(s.get(f"round/{r}/failed")))  # be earlier
            _say(_summary(failure, r + 1, max_restarts))
            reply_to_parent(environ, failure,  # the launcher's TORCHELASTIC_ERROR_FILE
                            agent.error_dir if failure.node_rank == cfg.node_rank else None)
            agent.finish()
            return failure.exit_code or 1
    except _Terminated as t:
        name = signal.Signals(t.signum).name
        if agent is not None:
            if agent.group is not None:  # the same signal (SIGINT: KeyboardInterrupt)
                agent.group.stop(cfg.shutdown_timeout, t.signum)
            try:
                agent.store.set("job/abort", "1")
                how = f"stopped: the launcher of node {cfg.node_rank} got {name}"
                blob = json.dumps(Failure(-1, -1, cfg.node_rank, 128 + t.signum, how, "",
                                          r)._asdict())
                agent.store.compare_set(f"round/{r}/failed", "", blob)
            except (StoreError, OSError):
                pass
            _say(f"got {name}; stopped every worker")
            agent.finish()
        else:
            _say(f"got {name} while starting; no worker was running")
        return 128 + t.signum
    except (LaunchError, StoreError) as e:
        if agent is not None and agent.group is not None:
            agent.group.stop(cfg.shutdown_timeout)
        _say(f"error: {e}")
        return 1
    finally:
        if agent is not None:
            agent.stop_heartbeats()
            if agent.group is not None:
                agent.group.stop(0.0)
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
        if agent is not None:
            shutil.rmtree(agent.error_dir, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)

