"""Membership of ``jdist-run``'s launchers: the store, node slots and the job's rounds.

Every launcher of a job meets the others through one store (under the prefix
``jdist-run/``, or ``jdist-run/<--rdzv-id>/``). One node is a
:class:`~jdist.store.HashStore` in the launcher. With several, one launcher hosts a
:class:`~jdist.store.TCPStore` at ``--master-addr:--master-port`` (``--rdzv-endpoint``)
and is the job's **leader**; the others connect:

- with ``--node-rank`` (or SLURM's), node 0 hosts, and a node's **slot** is its rank;
- without it (torchrun's c10d rendezvous), every launcher tries to host on the endpoint
  and the first to bind it does (``--rdzv-conf is_host=...`` decides instead); the
  others connect. Slots are handed out in the order the launchers join.

Keys: ``rdzv/ranks`` (``fixed`` or ``joined``: every launcher must give ``--node-rank``
or none), ``rdzv/slots`` (the join counter), ``node/<slot>/nproc`` (a launcher that
registered), ``node/<slot>/claim`` (a fixed rank is used once), ``node/<slot>/left``
(gave up waiting), ``job/token``, ``job/run_id``, ``job/max_restarts``, ``job/nnodes``
(the leader's values; ``--nnodes`` must agree), ``round/<r>/members`` (JSON list of the
round's slots, the leader first: a node's ``GROUP_RANK`` is its index there),
``round/<r>/port`` (its workers' MASTER_PORT), ``round/<r>/spent`` (restarts spent
before it), ``job/round`` (the last round opened) and ``job/finished``.

Rounds follow torch's elastic rules: round 0 starts when ``MAX`` nodes joined, or when
``MIN`` did and the last call (``--rdzv-conf last_call_timeout``, 30 s) passed without
more. A launcher that registers while a round runs waits; the leader then ends the round
(no restart is spent) and opens the next with it, while there is room below ``MAX``.
"""

from __future__ import annotations

import errno
import json
import secrets
import sys
import time
from typing import NamedTuple

from jdist.errors import StoreListenError, StoreTimeoutError
from jdist.launch._config import LaunchConfig
from jdist.store import HashStore, PrefixStore, Store, TCPStore, free_port

__all__ = ["LaunchError", "Rendezvous", "Terms", "say"]

_POLL_S = 0.05
_WAIT_POLL_S = 0.2
_NOT_HERE = (errno.EADDRINUSE, errno.EADDRNOTAVAIL)  # bind failed: another host / launcher


class LaunchError(RuntimeError):
    """The launchers could not form or run the job (not a worker failure)."""


class Terms(NamedTuple):
    """What the leader decided for the whole job."""

    token: str
    run_id: str
    max_restarts: int


def say(msg: str) -> None:
    """One line of the launcher's own on stderr (``jdist-run: ...``)."""
    sys.stderr.write(f"jdist-run: {msg}\n")
    sys.stderr.flush()


def _where(cfg: LaunchConfig) -> str:
    return f"{cfg.master_addr}:{cfg.master_port}"


def open_store(cfg: LaunchConfig, token: str | None) -> tuple[Store, bool]:
    """The launchers' store and whether this launcher hosts it (is the leader)."""
    if cfg.nnodes == 1:
        return HashStore(timeout=cfg.rdzv_timeout), True
    kw = dict(timeout=cfg.rdzv_timeout, auth_token=token)
    host = cfg.is_host if cfg.node_rank is None else cfg.node_rank == 0
    if host is not False:
        try:
            return TCPStore(cfg.master_addr, cfg.master_port, is_master=True,
                            wait_for_workers=False, **kw), True
        except StoreListenError as e:
            if host or e.errno not in _NOT_HERE:
                raise LaunchError(f"cannot host the launchers' store at {_where(cfg)}: "
                                  f"{e}") from e
        except OSError as e:  # the address does not resolve
            raise LaunchError(f"cannot host the launchers' store at {_where(cfg)}: "
                              f"{e}") from e
    try:
        return TCPStore(cfg.master_addr, cfg.master_port, **kw), False
    except OSError as e:
        who = "node 0" if cfg.node_rank is not None else "the first launcher"
        raise LaunchError(f"cannot reach the launchers' store at {_where(cfg)} (hosted by "
                          f"{who}) within --rdzv-timeout {cfg.rdzv_timeout:g}s: {e}") from e


class Rendezvous:
    """This launcher's view of the job's membership (see the module docstring)."""

    def __init__(self, cfg: LaunchConfig, token: str | None):
        self.cfg = cfg
        self._base, self.leader = open_store(cfg, token)
        # jobs with their own --rdzv-id may share an endpoint (as torch's rendezvous ids)
        prefix = "jdist-run" if cfg.run_id is None else f"jdist-run/{cfg.run_id}"
        self.store: Store = PrefixStore(prefix, self._base)
        self.env_token = token
        self.fixed = cfg.node_rank is not None
        self.slot = cfg.node_rank if self.fixed else -1
        self.opened = -1  # leader: the last round it opened

    def close(self) -> None:
        """Close this launcher's connection (the host: its store stops once the
        heartbeat thread's connection is closed too)."""
        close = getattr(self._base, "close", None)
        if close is not None:
            close()

    # --- joining ---------------------------------------------------------------------
    def join(self) -> Terms:
        """Register this launcher; the leader also publishes the terms and opens round 0."""
        cfg, s = self.cfg, self.store
        mode = "fixed" if self.fixed else "joined"
        if s.compare_set("rdzv/ranks", "", mode).decode() != mode:
            raise LaunchError("some launchers of this job were given --node-rank and others "
                              "not; give it to every launcher or to none (then ranks "
                              "follow the order in which launchers join)")
        if self.fixed and s.add(f"node/{self.slot}/claim", 1) > 1:
            raise LaunchError(f"--node-rank {self.slot} is used by two launchers; give "
                              f"each launcher its own node rank in [0, {cfg.nnodes})")
        if self.leader:
            s.multi_set(["job/token", "job/run_id", "job/max_restarts", "job/nnodes"],
                        [self.env_token or secrets.token_hex(16),
                         cfg.run_id or secrets.token_hex(8), str(cfg.max_restarts),
                         self._nnodes_text()])
        terms = self._terms()  # (checked before registering: a mismatch never joins)
        if not self.fixed:
            self.slot = s.add("rdzv/slots", 1) - 1
        s.set(f"node/{self.slot}/nproc", str(cfg.nproc_per_node))
        if self.leader:
            self.open_round(0, self._gather())
        return terms

    def _nnodes_text(self) -> str:
        cfg = self.cfg
        return f"{cfg.min_nodes}:{cfg.nnodes}" if cfg.min_nnodes is not None else str(
            cfg.nnodes)

    def _terms(self) -> Terms:
        cfg, s = self.cfg, self.store
        try:
            s.wait(["job/token"], cfg.rdzv_timeout)
        except StoreTimeoutError:
            raise LaunchError(f"the launcher hosting the store at {_where(cfg)} did not "
                              f"start the job within --rdzv-timeout "
                              f"{cfg.rdzv_timeout:g}s") from None
        token, run_id, max_restarts, nnodes = (v.decode() for v in s.multi_get(
            ["job/token", "job/run_id", "job/max_restarts", "job/nnodes"]))
        if nnodes != self._nnodes_text():
            raise LaunchError(f"the job runs --nnodes {nnodes} but this launcher "
                              f"--nnodes {self._nnodes_text()}; use the same value "
                              f"everywhere")
        if int(max_restarts) != cfg.max_restarts:
            say(f"the job runs --max-restarts {max_restarts}; using it instead of "
                f"{cfg.max_restarts}")
        return Terms(token, run_id, int(max_restarts))

    def registered(self) -> list[int]:
        """Slots of every launcher that registered so far and did not leave."""
        s = self.store
        count = self.cfg.nnodes if self.fixed else s.add("rdzv/slots", 0)
        return [i for i in range(count) if s.check([f"node/{i}/nproc"])
                and not s.check([f"node/{i}/left"])]

    def _gather(self) -> list[int]:
        """Leader: round 0's slots (``MAX`` of them, or at least ``MIN`` once the last
        call passed)."""
        cfg = self.cfg
        deadline = time.monotonic() + cfg.rdzv_timeout
        last_call = None
        while True:
            joined = self.registered()
            now = time.monotonic()
            if len(joined) >= cfg.nnodes:
                return self.choose([], joined)
            if len(joined) >= cfg.min_nodes:
                last_call = last_call or now + min(cfg.last_call_timeout, cfg.rdzv_timeout)
                if now >= last_call:
                    say(f"starting with {len(joined)} node{'s' * (len(joined) > 1)} of "
                        f"--nnodes {cfg.min_nodes}:{cfg.nnodes}")
                    return self.choose([], joined)
            if now > deadline:
                raise LaunchError(self._short(joined))
            time.sleep(_POLL_S)

    def _short(self, joined: list[int]) -> str:
        cfg = self.cfg
        if self.fixed:
            missing = [i for i in range(cfg.nnodes) if i not in joined]
            return (f"node ranks {missing} did not join within --rdzv-timeout "
                    f"{cfg.rdzv_timeout:g}s; start one launcher per node rank with the same "
                    f"--nnodes/--master-addr/--master-port")
        return (f"{len(joined)} of at least {cfg.min_nodes} launchers joined within "
                f"--rdzv-timeout {cfg.rdzv_timeout:g}s; start them with the same --nnodes "
                f"and --rdzv-endpoint (or --master-addr/--master-port)")

    def choose(self, live: list[int], waiting: list[int]) -> list[int]:
        """The next round's slots, at most ``MAX``: the leader first (its workers are
        ranks 0...: its host picks their MASTER_PORT), then the live members and the
        waiting launchers, ascending (a launcher's place in the join order)."""
        rest = sorted({*live, *waiting} - {self.slot})
        keep = sorted(i for i in rest if i in live)
        room = self.cfg.nnodes - 1 - len(keep)
        return [self.slot, *sorted(keep + [i for i in rest if i not in live][:max(room, 0)])]

    # --- rounds ----------------------------------------------------------------------
    def open_round(self, r: int, members: list[int], spent: int = 0) -> None:
        """Leader: publish round ``r``'s members, its workers' port and the restarts the
        job spent before it."""
        cfg = self.cfg
        port = cfg.master_port  # one node: the launcher holds no port; --master-port is
        if cfg.nnodes > 1 or port is None:  # the workers' (as torchrun's MASTER_PORT)
            port = free_port(cfg.master_addr)
        self.store.multi_set([f"round/{r}/members", f"round/{r}/port", f"round/{r}/spent"],
                             [json.dumps(members), str(port), str(spent)])
        self.store.set("job/round", str(r))
        self.opened = r

    def members(self, r: int) -> list[int]:
        return json.loads(self.store.get(f"round/{r}/members"))

    def port(self, r: int) -> int:
        return int(self.store.get(f"round/{r}/port"))

    def spent(self, r: int) -> int:
        return int(self.store.get(f"round/{r}/spent"))

    def nprocs(self, members: list[int]) -> list[int]:
        """Processes of each member (in the order of ``members``)."""
        keys = [f"node/{i}/nproc" for i in members]
        return [int(v) for v in self.store.multi_get(keys)]

    def newcomers(self, members: list[int]) -> list[int]:
        """Launchers that registered, are not in ``members`` and still wait."""
        s = self.store
        return [i for i in self.registered() if i not in members
                and not s.check([f"node/{i}/dead"])]

    def first_round(self) -> int | None:
        """The first round that has this launcher as a member (the leader: 0); None when
        the job finished before it could join. Raises when none comes in time."""
        if self.leader:
            return 0
        cfg, s = self.cfg, self.store
        deadline = time.monotonic() + cfg.rdzv_timeout
        r, told = 0, False
        while True:
            if s.check([f"round/{r}/members"]):
                if self.slot in self.members(r):
                    return r
                r += 1
                if not told:
                    told = True
                    say(f"the job is running; node {self.slot} waits to join its next round "
                        f"(--nnodes {cfg.min_nodes}:{cfg.nnodes})")
                continue
            if s.check(["job/finished"]):
                return None
            if s.check(["job/abort"]):
                raise LaunchError("the job was stopped before this launcher could join it")
            if time.monotonic() > deadline:
                s.set(f"node/{self.slot}/left", "1")
                raise LaunchError(f"node {self.slot} found no room in the job within "
                                  f"--rdzv-timeout {cfg.rdzv_timeout:g}s: it runs "
                                  f"--nnodes {cfg.min_nodes}:{cfg.nnodes} and was full")
            time.sleep(_WAIT_POLL_S)

    def expected_exits(self) -> int:
        """Leader: how many launchers will say goodbye (registered, not lost or gone)."""
        s = self.store
        return len([i for i in self.registered() if not s.check([f"node/{i}/dead"])])
