"""The per-node agent of ``jdist-run``: rounds of workers, failures, restarts.

Launchers agree through a store (``_rendezvous``: who hosts it, node slots, the members
of each round). Keys, under the prefix ``jdist-run/``, besides the rendezvous's:

- ``round/<r>/port``: the workers' MASTER_PORT of attempt ``r``, a free port that the
  leader (the store's host, whose workers are ranks 0...) picks for each attempt. It
  differs from the launchers' store port, so the job's processes run their own
  rendezvous (``init_process_group``) undisturbed;
- ``round/<r>/failed``: the first failure of attempt ``r``: the earliest by its time
  (``_blame``: a rank's recorded exception or fatal signal, not the order in which
  launchers noticed exits), kept by a ``compare_set`` loop, so every node reports the
  same rank; the other nodes poll it, add an earlier failure of their own, and stop
  their workers;
- ``round/<r>/regroup``: the leader ended attempt ``r`` because a launcher joined (with
  ``--nnodes MIN:MAX`` and room below MAX): the next attempt has it, no restart spent;
- ``round/<r>/done`` / ``round/<r>/stopped``: counters of nodes whose workers
  finished / were stopped; a new attempt starts when every node stopped the last one;
- ``hb/<slot>``: a counter each launcher bumps every second from a thread with its own
  connection; a launcher whose counter stands still for ``--heartbeat-timeout`` is
  declared gone (``node/<slot>/dead``; its workers died with it: they get SIGKILL when
  their launcher dies), and the job goes on without it down to MIN nodes, or stops;
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
import shutil
import signal
import sys
import tempfile
import threading
import time

from jdist.errors import StoreError
from jdist.launch._blame import candidate, error_file_env, first_failure, reply_to_parent
from jdist.launch._config import LaunchConfig
from jdist.launch._env import (
    JobInfo,
    has_user_cache,
    restart_cache_env,
    worker_env,
)
from jdist.launch._forkserver import worker_launch
from jdist.launch._ft_agent import run_ft
from jdist.launch._relay import binary_stream
from jdist.launch._rendezvous import LaunchError, Rendezvous, Terms
from jdist.launch._rendezvous import say as _say
from jdist.launch._stop import signal_group
from jdist.launch._worker_group import (
    Failure,
    Worker,
    WorkerGroup,
    describe_exit,
    exit_code_of,
)
from jdist.store import Store

__all__ = ["run", "LaunchError"]

_POLL_S = 0.05
_REMOTE_POLL_S = 0.2
_BEAT_S = 1.0
_JOIN_POLL_S = 0.5  # the leader looks for launchers that want to join this often


class _Terminated(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _Agent:
    def __init__(self, cfg: LaunchConfig, environ: dict[str, str]):
        self.cfg = cfg
        self.environ = environ
        self.group: WorkerGroup | None = None
        self.rdzv = Rendezvous(cfg, environ.get("JDIST_AUTH_TOKEN") or None)
        self.store: Store = self.rdzv.store
        self.round = 0
        self.silent_node: int | None = None
        self.members: list[int] = []  # node slots of this attempt
        self.lock = threading.Lock()
        self._stop_beats = threading.Event()
        self._beats: threading.Thread | None = None
        # the workers' failure records (``_blame``), one folder per attempt
        self.error_dir = tempfile.mkdtemp(prefix="jdist-run-errors-")

    # --- heartbeats ----------------------------------------------------------------------
    def start_heartbeats(self) -> None:
        """Beat, and watch the other launchers' beats, from a daemon thread."""
        if self.cfg.nnodes > 1:
            self._beats = threading.Thread(target=self._beat_loop, args=(self.store.clone(),),
                                           daemon=True, name="jdist-run-heartbeat")
            self._beats.start()

    def _beat_loop(self, store: Store) -> None:
        cfg = self.cfg
        seen: dict[int, tuple[int, float]] = {}
        dead: set[int] = set()
        try:
            while not self._stop_beats.wait(_BEAT_S):
                store.add(f"hb/{self.slot}", 1)
                now = time.monotonic()
                with self.lock:
                    members = list(self.members)
                for i in members:
                    if i == self.slot or i in dead or store.check([f"node/{i}/exited"]):
                        continue  # (a launcher that left after its exit barrier)
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

    def close(self) -> None:
        """Stop beating and close the store connections (the host's store stops)."""
        self._stop_beats.set()
        if self._beats is not None:
            self._beats.join(2 * _BEAT_S)
        self.rdzv.close()

    @property
    def slot(self) -> int:
        """This launcher's node slot (``--node-rank``, or its place in the join order)."""
        return self.rdzv.slot

    def live(self) -> list[int]:
        """This attempt's nodes that are not known to be gone."""
        with self.lock:
            members = list(self.members)
        return [i for i in members if not self.store.check([f"node/{i}/dead"])]

    def staying(self) -> list[int]:
        """Live nodes whose launcher did not leave after its exit barrier."""
        return [i for i in self.live() if not self.store.check([f"node/{i}/exited"])]

    # --- one attempt ---------------------------------------------------------------------
    def start(self, job: JobInfo) -> WorkerGroup:
        cfg = self.cfg
        argv, start = worker_launch(os.getpid(), cfg.script, cfg.script_args, cfg.module,
                                    cfg.no_python, cfg.start_method, cfg.preload)
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
        self.group = WorkerGroup(cmds, binary_stream(sys.stdout), binary_stream(sys.stderr),
                                 log_dir,
                                 cfg.hidden, cfg.verbose, start)
        return self.group

    def watch(self, group: WorkerGroup, r: int) -> Failure | None:
        """Wait for the attempt to end; the first failure (local or remote) or None."""
        cfg, s = self.cfg, self.store
        failed_key = f"round/{r}/failed"
        last_remote = last_join = time.monotonic()
        while True:
            failed, running = group.poll()
            if failed:
                mine = _first_on_node(group, self.slot, r)  # before any signal
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
                    mine = _first_on_node(group, self.slot, r)
                    first = Failure(**json.loads(s.get(failed_key)))
                    if mine is not None:
                        first = _report_earliest(s, failed_key, mine)
                    group.stop(cfg.shutdown_timeout)
                    return first
            if self.rdzv.leader and time.monotonic() - last_join >= _JOIN_POLL_S:
                last_join = time.monotonic()
                first = self._regroup_for_newcomers(r)
                if first is not None:
                    group.stop(cfg.shutdown_timeout)
                    return first
            time.sleep(_POLL_S)
        group.stop(0.0)  # every worker exited 0; reap stragglers in their groups
        s.add(f"round/{r}/done", 1)
        return self._exit_barrier(r)

    def _exit_barrier(self, r: int) -> Failure | None:
        """This node's workers of attempt ``r`` finished: wait for the other nodes' (they
        may still fail), at most ``--exit-barrier-timeout`` (torch's exit barrier, which
        never fails the job). The store's host waits for every live node regardless:
        leaving would stop the store their launchers need."""
        cfg, s = self.cfg, self.store
        deadline = time.monotonic() + cfg.exit_barrier_timeout
        told = False
        while True:
            if s.check([f"round/{r}/failed"]):
                return Failure(**json.loads(s.get(f"round/{r}/failed")))
            if s.add(f"round/{r}/done", 0) >= len(self.live()):
                return None
            if time.monotonic() >= deadline and not told:
                told = True
                how = (f"node {self.slot}'s workers finished; the other nodes' did not "
                       f"within --exit-barrier-timeout {cfg.exit_barrier_timeout:g}s")
                if not self.rdzv.leader:
                    _say(f"{how}: leaving without them (the job goes on)")
                    return None
                _say(f"{how}; node {self.slot} hosts the launchers' store and waits for "
                     f"them (leaving would stop their job)")
            time.sleep(_REMOTE_POLL_S)

    def _regroup_for_newcomers(self, r: int) -> Failure | None:
        """Leader: end attempt ``r`` when launchers wait to join and there is room (torch
        restarts its workers when a node waits, without spending a restart)."""
        cfg, s = self.cfg, self.store
        with self.lock:
            members = list(self.members)
        if len(members) >= cfg.nnodes or s.add(f"round/{r}/done", 0) > 0:
            return None
        new = self.rdzv.newcomers(members)
        if not new:
            return None
        s.set(f"round/{r}/regroup", "1")  # before the failure key: readers see both
        how = f"stopped: the launcher of node {', '.join(map(str, new))} joined"
        blob = json.dumps(Failure(-1, -1, new[0], 0, how, "", r)._asdict())
        return Failure(**json.loads(s.compare_set(f"round/{r}/failed", "", blob)))

    def sync_stop(self, r: int) -> None:
        """Wait until every node stopped its workers of attempt ``r``."""
        cfg, s = self.cfg, self.store
        s.add(f"round/{r}/stopped", 1)
        deadline = time.monotonic() + cfg.rdzv_timeout
        while s.add(f"round/{r}/stopped", 0) < len(live := self.staying()):
            if len(live) < cfg.min_nodes:
                gone = [i for i in self.live() if i not in live]
                raise LaunchError(
                    f"the launcher of node {self.silent_node} stopped responding; cannot "
                    f"restart without it" if not gone else f"the launcher of node "
                    f"{gone[0]} left after its exit barrier (--exit-barrier-timeout); "
                    f"cannot restart without it")
            if time.monotonic() > deadline:
                raise LaunchError(f"not every node stopped its workers of attempt {r + 1} "
                                  f"within {cfg.rdzv_timeout:g}s")
            time.sleep(_POLL_S)

    def finish(self, code: int = 0) -> None:
        """Say goodbye; the store's host records the job's exit ``code`` for launchers
        still waiting to join, and keeps the store up until the others left (or 10 s)."""
        try:
            self.store.set(f"node/{self.slot}/exited", "1")  # (its heartbeats stop)
            self.store.add("job/exited", 1)
            if self.rdzv.leader and self.cfg.nnodes > 1:  # (lost nodes are not waited for)
                self.store.set("job/finished", str(code))
                deadline = time.monotonic() + 10.0
                while (self.store.add("job/exited", 0) < self.rdzv.expected_exits()
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


def _job(agent: _Agent, terms: Terms, r: int, spent: int) -> JobInfo:
    """Round ``r``'s terms for this node (its members, their processes, the port, the
    restarts spent so far: the leader's ``spent``, so a node that joined late agrees)."""
    cfg, rdzv = agent.cfg, agent.rdzv
    if rdzv.leader and r > rdzv.opened:
        live = agent.staying()
        rdzv.open_round(r, rdzv.choose(live, rdzv.newcomers(live)), spent)
    members = rdzv.members(r)
    if agent.slot not in members:
        raise LaunchError(f"node {agent.slot} was left out of attempt {r + 1} (members "
                          f"{members}); restart it to join the job again")
    with agent.lock:
        agent.members = members
    agent.round = r
    nprocs, mine = rdzv.nprocs(members), members.index(agent.slot)
    return JobInfo(sum(nprocs), sum(nprocs[:mine]), len(members), mine, cfg.nproc_per_node,
                   cfg.master_addr, rdzv.port(r), terms.token, terms.run_id, r,
                   terms.max_restarts, restarts_spent=rdzv.spent(r))


def _regroup(agent: _Agent, failure: Failure, r: int) -> bool:
    """Whether attempt ``r`` ended for a change of members (a launcher lost or joined),
    which restarts the job without spending a restart; says so."""
    cfg, s = agent.cfg, agent.store
    if failure.rank >= 0 or s.check(["job/abort"]):
        return False
    with agent.lock:
        members = list(agent.members)
    lost = [i for i in members if i not in agent.live()]
    if lost:
        _say(f"the launcher of node {', '.join(map(str, lost))} stopped responding; "
             f"continuing with {len(members) - len(lost)} nodes (--nnodes "
             f"{cfg.min_nodes}:{cfg.nnodes}), attempt {r + 2}")
        return True
    if s.check([f"round/{r}/regroup"]):
        _say(f"{failure.how.removeprefix('stopped: ')}; restarting the job with it (attempt "
             f"{r + 2}; --nnodes {cfg.min_nodes}:{cfg.nnodes}, no restart spent)")
        return True
    return False


def _rounds(agent: _Agent, terms: Terms, r: int, environ: dict[str, str]) -> int:
    """Run attempts from round ``r`` until the job succeeds or fails for good."""
    cfg, s = agent.cfg, agent.store
    used = 0  # restarts spent on failures (a change of members spends none)
    while True:
        job = _job(agent, terms, r, used)
        used = job.restarts_spent  # (torch's TORCHELASTIC_RESTART_COUNT)
        failure = agent.watch(agent.start(job), r)
        agent.group = None
        if failure is None:
            agent.finish()
            return 0
        if _regroup(agent, failure, r):
            agent.sync_stop(r)
            r += 1
            continue
        if used < terms.max_restarts and not s.check(["job/abort"]):
            used += 1
            who = f"rank {failure.rank}" if failure.rank >= 0 else "a launcher"
            _say(f"{who} {failure.how}; restarting the job (attempt {r + 2} of "
                 f"{terms.max_restarts + 1 + r + 1 - used})")
            agent.sync_stop(r)
            r += 1
            continue
        if cfg.nnodes > 1 and s.check([f"round/{r}/failed"]):  # another node's may
            failure = Failure(**json.loads(s.get(f"round/{r}/failed")))  # be earlier
        _say(_summary(failure, r + 1, terms.max_restarts))
        reply_to_parent(environ, failure,  # the launcher's TORCHELASTIC_ERROR_FILE
                        agent.error_dir if failure.node_rank == agent.slot else None)
        agent.finish(failure.exit_code or 1)
        return failure.exit_code or 1


def _script_problem(cfg: LaunchConfig) -> str | None:
    """Why ``cfg.script`` cannot be started (None: it can)."""
    if cfg.no_python and shutil.which(cfg.script) is None:
        return (f"--no-python: {cfg.script!r} is not an executable file (working directory "
                f"{os.getcwd()!r}); give its path, executable (chmod +x), or drop "
                f"--no-python for a Python script")
    if not cfg.module and not cfg.no_python and not os.path.isfile(cfg.script):
        return (f"script {cfg.script!r} not found (working directory {os.getcwd()!r}); "
                f"pass a path to a Python file, or -m for a module")
    return None


def run(cfg: LaunchConfig, environ: dict[str, str] | None = None) -> int:
    """Run the job described by ``cfg`` on this node; return the launcher's exit code.

    The launcher's SIGINT/SIGTERM/SIGHUP handlers are installed here and restored on
    every way out (an in-process caller gets its own handlers back)."""
    problem = _script_problem(cfg)
    if problem is not None:  # (before any handler is installed)
        _say(f"error: {problem}")
        return 2
    environ = dict(os.environ if environ is None else environ)
    if cfg.ft:
        return run_ft(cfg, environ)
    state = {"raised": False}

    def on_signal(signum, frame):
        if not state["raised"]:
            state["raised"] = True
            raise _Terminated(signum)

    previous = {}
    agent = None
    cache = None  # the attempts' compilation cache (a restarted attempt reuses it)
    try:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                previous[sig] = signal.signal(sig, on_signal)
        if cfg.detected:
            _say(cfg.detected)
        agent = _Agent(cfg, environ)
        terms = agent.rdzv.join()
        agent.start_heartbeats()
        first = agent.rdzv.first_round()
        if first is None:  # (the job's exit code: a failed job fails here too)
            code = int(agent.store.get("job/finished"))
            _say(f"the job ended (exit code {code}) before this launcher could join it; "
                 f"nothing to run")
            agent.finish()
            return code
        if (cfg.compilation_cache and (terms.max_restarts > 0 or cfg.min_nnodes is not None)
                and not has_user_cache(environ)):
            cache = tempfile.mkdtemp(prefix=f"jdist-run-{terms.run_id[:16]}-jax-cache-")
            environ.update(restart_cache_env(environ, cache))  # agent.environ too
        return _rounds(agent, terms, first, environ)
    except _Terminated as t:
        return _terminated(agent, t.signum)
    except (LaunchError, StoreError) as e:
        if agent is not None and agent.group is not None:
            agent.group.stop(cfg.shutdown_timeout)
        _say(f"error: {e}")
        return 1
    finally:
        if agent is not None:
            agent.close()
            if agent.group is not None:
                agent.group.stop(0.0)
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
        if agent is not None:
            shutil.rmtree(agent.error_dir, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _terminated(agent: _Agent | None, signum: int) -> int:
    """SIGINT/SIGTERM/SIGHUP to the launcher: stop the workers and the job."""
    name = signal.Signals(signum).name
    if agent is None:
        _say(f"got {name} while starting; no worker was running")
        return 128 + signum
    if agent.group is not None:  # the same signal (SIGINT: KeyboardInterrupt)
        agent.group.stop(agent.cfg.shutdown_timeout, signum)
    if agent.slot not in agent.members:  # still waiting to join: the job goes on
        try:
            agent.store.set(f"node/{agent.slot}/left", "1")
        except (StoreError, OSError):
            pass
        _say(f"got {name} while waiting to join the job; leaving it")
        return 128 + signum
    try:
        agent.store.set("job/abort", "1")
        how = f"stopped: the launcher of node {agent.slot} got {name}"
        blob = json.dumps(Failure(-1, -1, agent.slot, 128 + signum, how, "",
                                  agent.round)._asdict())
        agent.store.compare_set(f"round/{agent.round}/failed", "", blob)
    except (StoreError, OSError):
        pass
    _say(f"got {name}; stopped every worker")
    agent.finish(128 + signum)
    return 128 + signum
