"""``Manager``: torchft's per-step protocol on jdist's store, without a lighthouse.

Each step: :meth:`Manager.start_quorum` joins the next round and waits for its quorum
(the live replicas; one that died or stopped is left out after its heartbeat goes
silent), then heals this replica from a live peer if it is new or behind;
:meth:`Manager.allreduce` averages gradients over the quorum (weighted by samples);
:meth:`Manager.should_commit` votes and returns the round's single decision, so a
replica that dies mid-step changes nothing anywhere. The store lives in ``jdist-run
--ft``'s launcher, not in a worker: any worker, rank 0 included, may die.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jdist.errors import FtError, JobFinishedError, ReplicaLostError, StoreError
from jdist.ft import _rounds
from jdist.ft._healing import Registry
from jdist.ft._peers import Mailbox
from jdist.ft._pulse import Pulse
from jdist.ft._rounds import Quorum
from jdist.ft._rules import heal_plan, weighted_mean
from jdist.store import PrefixStore, Store, TCPStore

__all__ = ["Manager"]

_STORE_CHECK_S = 0.2  # a wait for a member's message reads the store's error after this


def _env_int(name: str, default: int | None) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise FtError(f"{name} must be an integer, got {value!r}") from None


def _default_store(timeout: float) -> Store:
    spec = os.environ.get("JDIST_FT_STORE")
    if not spec:
        raise FtError("jdist.ft.Manager needs a store that outlives any worker: run under "
                      "`jdist-run --ft` (it sets JDIST_FT_STORE=host:port) or pass store=")
    host, _, port = spec.rpartition(":")
    if not host or not port.isdigit():
        raise FtError(f"JDIST_FT_STORE must look like 127.0.0.1:29400, got {spec!r}")
    return TCPStore(host, int(port), is_master=False, timeout=timeout)


def _poison(mailbox: Mailbox, q: Quorum, me: int, e: Exception, timeout: float) -> None:
    """Tell every other member that this step failed here (under the gradient key, so
    an allreduce waiting for this replica's part fails at once)."""
    poison = [np.asarray([-1], np.int64), str(e).encode()[:4096]]
    for m in q.members:
        if m != me:
            mailbox.post(m, q.info[m]["addr"], f"r{q.round}/grad", poison, timeout)


class Manager:
    """Quorum, commit and healing for one replica (torchft's ``Manager``).

    Args:
      min_replicas: the fewest replicas a step may commit with.
      replica_id: this replica's id (default ``$RANK``); a replacement reuses its id.
      world_size: the replicas the job starts with (default ``$WORLD_SIZE``); the
        first round waits ``join_timeout`` for all of them.
      store: where rounds are agreed (default ``$JDIST_FT_STORE``, the launcher's).
      timeout: seconds any one wait may take (for a quorum, each peer's message, the
        vote).
      join_timeout: seconds a live replica may be late to a round before it is left
        out (it joins the next one).
      heartbeat_timeout: seconds without a heartbeat after which a replica counts as
        lost (dead, stopped, or hung holding the GIL).
      auth_token: the job's secret (default ``$JDIST_AUTH_TOKEN``).
      host: the address this replica's mailbox listens on.
    """

    def __init__(self, *, min_replicas: int = 1, replica_id: int | None = None,
                 world_size: int | None = None, store: Store | None = None,
                 timeout: float = 30.0, join_timeout: float = 5.0,
                 heartbeat_timeout: float = 2.0, auth_token: str | bytes | None = None,
                 host: str = "127.0.0.1"):
        self.replica_id = _env_int("RANK", 0) if replica_id is None else int(replica_id)
        self.world_size = _env_int("WORLD_SIZE", 1) if world_size is None else int(world_size)
        if not 0 <= self.replica_id < self.world_size or min_replicas < 1:
            raise FtError(f"need 0 <= replica_id < world_size and min_replicas >= 1, got "
                          f"replica_id={self.replica_id}, world_size={self.world_size}, "
                          f"min_replicas={min_replicas}")
        self.min_replicas, self.timeout = int(min_replicas), float(timeout)
        self.join_timeout = float(join_timeout)
        token = auth_token if auth_token is not None else os.environ.get("JDIST_AUTH_TOKEN")
        token = token.encode() if isinstance(token, str) else token
        base = store if store is not None else _default_store(self.timeout)
        run = os.environ.get("JDIST_RUN_ID", "")
        self._store = PrefixStore(f"ft/{run}/", base)
        self.incarnation = _env_int("JDIST_FT_INCARNATION", 0)
        self._mailbox = Mailbox(self.replica_id, self.incarnation, token or b"", host)
        self._pulse_conn = base.clone()  # the heartbeat's own connection
        self._pulse = Pulse(PrefixStore(f"ft/{run}/", self._pulse_conn), self.replica_id,
                            self.incarnation, self.world_size, heartbeat_timeout / 4,
                            heartbeat_timeout)
        self._step, self._synced, self._round = 0, False, -1
        self._quorum: Quorum | None = None
        self._error: Exception | None = None
        self._decided = True
        self._state = Registry()
        self._on_commit: list[Callable[[Quorum], None]] = []
        self._previous_members: set[int] = set()
        self._closed = False
        self._wanting = False  # this replica's want/<id> key is set
        atexit.register(self.close)
        self._last = -1  # the round of this replica's last commit (its lineage)
        self.register_state("manager", lambda: {"step": self._step, "last": self._last},
                            self._load_own)

    # -- registration ------------------------------------------------------------
    def register_state(self, name: str, get: Callable[[], Any],
                       load: Callable[[Any], None]) -> None:
        """Heal ``name`` too: ``get()`` returns a pytree, ``load(tree)`` takes one."""
        self._state.register(name, get, load)

    def on_commit(self, callback: Callable[[Quorum], None]) -> None:
        """Call ``callback(quorum)`` after each committed step (e.g. a sampler)."""
        self._on_commit.append(callback)

    def _load_own(self, tree) -> None:
        self._step, self._last = int(tree["step"]), int(tree["last"])

    # -- the step ----------------------------------------------------------------
    def start_quorum(self) -> Quorum:
        """Join the next round, wait for its quorum, heal if behind; returns the quorum.

        A member that stepped with the others to the step the job finished at gets
        its last quorum back with ``stop=True`` (it ends like the others) even when the
        round that carried the stop is not found for it.

        Raises:
          JobFinishedError: the job ended (``finish``) before this replica got in.
          FtError: no quorum within ``timeout`` (fewer than ``min_replicas`` live).
        """
        if not self._decided:
            self.should_commit()
        deadline = time.monotonic() + self.timeout + self.join_timeout
        # a member goes on with the next round (maybe presealed with it already); a
        # new replica starts after the newest sealed one
        r = self._round + 1 if self._round >= 0 else _rounds.last_sealed(self._store) + 1
        while True:
            self._pulse.enter(self._step, f"joining round {r}")
            q = _rounds.sealed_round(self._store, r)  # (presealed after a commit)
            if q is None:
                try:
                    q = self._join(r, deadline)
                except JobFinishedError:
                    if self._ended_with_the_job():
                        return self._quorum._replace(stop=True)
                    raise
            if q is not None and self._member(q):
                break
            r = max(r + 1, _rounds.last_sealed(self._store) + 1)
        self._begin(q)
        return q

    def _ended_with_the_job(self) -> bool:
        """Whether this replica has been a member (``_begin`` sets the quorum only for
        one; ``start_quorum`` decided its last round first) and is at the step the job
        finished at (the state every finished replica holds)."""
        if self._quorum is None:
            return False
        try:
            return int(self._store.get("done")) == self._step
        except (StoreError, ValueError):
            return False

    def _member(self, q: Quorum) -> bool:
        """Whether this process (this incarnation of the replica id) is in ``q``."""
        me = q.info.get(self.replica_id)
        return me is not None and int(me["inc"]) == self.incarnation

    def _join(self, r: int, deadline: float) -> Quorum | None:
        """Join round ``r`` and wait for its quorum (None: sealed without this replica
        and forgotten, or the job finished meanwhile)."""
        if self._store.check(["done"]):
            raise JobFinishedError(f"replica {self.replica_id}: the job finished at step "
                                   f"{int(self._store.get('done'))}; nothing to join")
        if not self._wanting:  # (no round is presealed without this replica meanwhile)
            self._store.set(f"want/{self.replica_id}", "1")
            self._wanting = True
        _rounds.join(self._store, r, self.replica_id, self._info())
        try:
            return _rounds.seal_wait(self._store, r, self.world_size, self.min_replicas,
                                     self._pulse.live, self.join_timeout, deadline)
        except StoreError as e:
            raise FtError(f"replica {self.replica_id} at step {self._step}: {e}") from e

    def _info(self) -> dict:
        return {"step": self._step, "last": self._last, "synced": self._synced,
                "addr": self._mailbox.address, "inc": self.incarnation, "pid": os.getpid()}

    def _begin(self, q: Quorum) -> None:
        self._quorum, self._round, self._error, self._decided = q, q.round, None, False
        if self._wanting:
            self._store.delete_key(f"want/{self.replica_id}")
            self._wanting = False
        if not q.pre:  # (a joined line is news of life; a presealed round is not)
            for m in q.members:
                self._pulse.vouch(m, int(q.info[m]["inc"]))
        self._say_left_out(q)
        self._mailbox.forget(lambda key: int(key[1:].split("/")[0]) >= q.round)
        if q.members[0] == self.replica_id:  # (on the heartbeat's connection, off the step)
            self._pulse.later(lambda store, r=q.round: _rounds.forget_through(store, r))
        try:
            self._heal(q)
        except ReplicaLostError as e:
            self._fail(e)
        self._pulse.enter(self._step, f"step of round {q.round}")

    def _say_left_out(self, q: Quorum) -> None:
        previous = self._previous_members
        self._previous_members = set(q.members)
        for r in sorted(previous - set(q.members)):
            print(f"jdist.ft: replica {self.replica_id}: replica {r} left out of round "
                  f"{q.round} (step {self._step}): "
                  f"{self._pulse.report(r, f'round {q.round}')}", file=sys.stderr)

    def _heal(self, q: Quorum) -> None:
        plan = heal_plan({m: int(q.info[m]["last"]) for m in q.members},
                         {m: bool(q.info[m]["synced"]) for m in q.members})
        key = f"r{q.round}/heal"
        for healer, source in plan.items():
            if source == self.replica_id:
                self._mailbox.post(healer, q.info[healer]["addr"], key,
                                   self._state.frames(), self.timeout)
        if self.replica_id in plan:
            source = plan[self.replica_id]
            self._state.load(self._take(key, source, "healing"), f"replica {source}")
        self._synced = True

    def _alive(self, member: int) -> bool:
        return self._pulse.alive(member, int(self._quorum.info[member]["inc"]))

    def _take(self, key: str, sender: int, what: str):
        r = self._round

        started, asked = time.monotonic(), [0.0]

        def check() -> None:
            if not self._alive(sender):
                raise ReplicaLostError(self._pulse.report(sender, f"{what} of round {r}"))
            why = self._mailbox.failure(f"r{r}/")
            if why is not None:
                raise ReplicaLostError(why)
            # a failed member poisons the gradient key through the mailbox; the store's
            # record (the only word for other keys) is read once a message is late,
            # not on every step's round trip
            now = time.monotonic()
            if now - started < _STORE_CHECK_S or now - asked[0] < _STORE_CHECK_S:
                return
            asked[0] = now
            if self._store.check([f"r{r}/err"]):
                raise ReplicaLostError(f"replica {int(self._store.get(f'r{r}/err'))} "
                                       f"failed round {r}")

        inc = int(self._quorum.info[sender]["inc"])
        return self._mailbox.take(key, (sender, inc), time.monotonic() + self.timeout,
                                  check, f"{what} of round {self._round}")

    def _fail(self, e: Exception) -> None:
        """Record this step's first failure and tell the other members at once (a
        poison message under the gradient key), so none waits for its deadline."""
        if self._error is not None:
            return
        self._error = e
        print(f"jdist.ft: replica {self.replica_id} at step {self._step}: {e}; this "
              f"step will not commit", file=sys.stderr)
        if self._quorum is not None:
            self._store.set(f"r{self._quorum.round}/err", str(self.replica_id))
            _poison(self._mailbox, self._quorum, self.replica_id, e, self.timeout)

    def allreduce(self, leaves: Sequence[np.ndarray], count: int) -> list[np.ndarray]:
        """The sample-weighted mean of every member's ``leaves`` (``count``: this
        replica's samples). After a failure this step, returns ``leaves`` unchanged
        (the step will not commit)."""
        q = self._require_quorum("allreduce")
        arrays = [np.asarray(x, order="C") for x in leaves]
        if self._error is not None:
            return arrays
        if len(q.members) == 1:
            return weighted_mean([arrays], [count])
        self._pulse.enter(self._step, f"allreduce of round {q.round}")
        key = f"r{q.round}/grad"
        frames = [np.asarray([count], np.int64), *arrays]
        try:
            for m in q.members:
                if m != self.replica_id:
                    self._mailbox.post(m, q.info[m]["addr"], key, frames, self.timeout)
            parts, counts = [], []
            for m in q.members:
                got = frames if m == self.replica_id else self._take(key, m, "allreduce")
                counts.append(int(np.frombuffer(got[0], np.int64)[0]))
                if counts[-1] < 0:
                    raise ReplicaLostError(f"replica {m} failed this step: "
                                           f"{bytes(got[1]).decode(errors='replace')}")
                parts.append([np.frombuffer(g, a.dtype).reshape(a.shape)
                              for g, a in zip(got[1:], arrays, strict=True)])
        except ReplicaLostError as e:
            self._fail(e)
            return arrays
        return weighted_mean(parts, counts)

    def report_error(self, e: Exception) -> None:
        """Make this step not commit (torchft's ``report_error``); call it before
        :meth:`should_commit`."""
        if self._decided:
            raise FtError(f"report_error({e!r}) after this step's should_commit: the step "
                          f"is decided already; report errors before should_commit")
        self._fail(e)

    def should_commit(self) -> bool:
        """Vote and return whether every member's step succeeded (the same answer on
        every member); on True the step counts and commit callbacks run."""
        q = self._require_quorum("should_commit")
        if self._decided:
            raise FtError("should_commit was already called for this step; call "
                          "start_quorum to begin the next one")
        self._pulse.enter(self._step, f"vote of round {q.round}")
        why = self._mailbox.failure(f"r{q.round}/")
        if why is not None:
            self._fail(ReplicaLostError(why))
        try:
            ok = _rounds.decide(self._store, q, self.replica_id, self._error is None,
                                self._alive, time.monotonic() + self.timeout,
                                self.world_size)
        except StoreError as e:
            raise FtError(f"replica {self.replica_id} at step {self._step}: {e}") from e
        self._decided = True
        if ok:
            self._step, self._last = self._step + 1, q.round
            for callback in self._on_commit:
                callback(q)
        return ok

    def _require_quorum(self, what: str) -> Quorum:
        if self._quorum is None:
            raise FtError(f"{what} needs a quorum: call start_quorum() first (the ft "
                          f"Optimizer's zero_grad() does)")
        return self._quorum

    # -- queries and control -------------------------------------------------------
    def current_step(self) -> int:
        """Committed steps so far (healed replicas take their source's count)."""
        return self._step

    @property
    def quorum(self) -> Quorum | None:
        return self._quorum

    def num_participants(self) -> int:
        return len(self._require_quorum("num_participants").members)

    def participant_rank(self) -> int:
        return self._require_quorum("participant_rank").rank(self.replica_id)

    def request_stop(self) -> None:
        """Ask every replica to stop: the next sealed quorum carries ``stop=True``."""
        self._store.set("stop", "1")

    def finish(self) -> None:
        """Mark the job finished: a replica still trying to join gets JobFinishedError."""
        self._store.compare_set("done", "", str(self._step))
        self.close()

    def close(self) -> None:
        """Stop the heartbeat and the mailbox, and wait for their threads (idempotent;
        also run at interpreter exit)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._pulse.close()
        self._mailbox.close()
        close = getattr(self._pulse_conn, "close", None)
        if close is not None:
            close()
