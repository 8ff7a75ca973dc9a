"""``CheckpointManager``: save a training state every few steps, resume it after a restart.

See :mod:`jdist.checkpoint` for what is saved and the guarantees; the pieces are
:mod:`~jdist.checkpoint._layout` (directories and agreement), ``_items`` (kinds of
values), ``_leaves`` (arrays), ``_orbax`` (the writes) and ``_restore``.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from jdist.checkpoint import _items, _layout, _leaves, _pack, _peers
from jdist.checkpoint._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
)
from jdist.checkpoint._orbax import Writer
from jdist.checkpoint._preempt import Preemption
from jdist.checkpoint._restore import StepReader, restore_items

__all__ = ["CheckpointManager", "restart_count"]

_OK, _CORRUPT, _MISMATCH = 0, 1, 2


def restart_count() -> int:
    """How many times the launcher restarted this job (0 on the first attempt).

    Read from ``JDIST_RESTART_COUNT`` (``jdist-run``) or ``TORCHELASTIC_RESTART_COUNT``.
    """
    for var in ("JDIST_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        if os.environ.get(var, "").strip().isdigit():
            return int(os.environ[var])
    return 0


def _rank_world() -> tuple[int, int]:
    import jax

    from jdist.collectives import get_rank, get_world_size, is_initialized

    if is_initialized():
        return get_rank(), get_world_size()
    return jax.process_index(), jax.process_count()


def _checksums(arrays: dict, meta: dict) -> None:
    """Fill in every buffer's checksum (in the writer's thread: it reads every byte),
    then the record's own, over everything else in it (``_pack.record_digest``)."""
    for name, rec in meta["buffers"].items():
        rec.update(_pack.buffer_checksum(arrays[name]))
    meta["digest"] = _pack.record_digest(meta)


_LEAN_WAIT_S = 2.0  # how long a rank other than 0 waits to learn whether rank 0 saves


def _entries(state: dict) -> list:
    """``[(name, kind, array leaves, comm-hook leaves), ...]`` of a state."""
    out = []
    for name, value in state.items():
        if not isinstance(name, str):
            raise TypeError(f"state keys must be strings, got {name!r}")
        kind = _items.kind_of(name, value)
        hook = _items.hook_leaves(value) if kind == "ddp" else []
        out.append((name, kind, value, _items.array_leaves(kind, value), hook))
    return out


def _make_part(step: int, entries: list, rank: int, world: int, whole: bool) -> tuple:
    """``(host values, JSON record)`` of this rank's part (``whole``: with every
    replicated value, as rank 0 writes them)."""
    values: list = []  # every piece this rank writes, still on its device
    recs: list = []  # its record in the JSON, filled in once the pieces are packed
    items = {}

    def leaf_entry(path, x, local):
        place, pieces = _leaves.host_pieces(x, 0 if whole else rank, local)
        mine = []
        for index, a in pieces:
            values.append(a)
            mine.append({"index": index})
            recs.append(mine[-1])
        return {"path": path, **_leaves.describe(x), "place": place, "pieces": mine}

    for name, kind, value, leaves, hook in entries:
        entry: dict[str, Any] = {"kind": kind}
        if kind in ("sampler", "np_rng", "json"):
            entry["json"] = _items.json_value(kind, value)
            _items.check_json(name, entry["json"])
        entry["leaves"] = [leaf_entry(p, x, kind in ("per_rank", "rngs")) for p, x in leaves]
        if kind == "ddp":
            entry["num_replicas"] = value.process_group.num_replicas
            entry["hook"] = [leaf_entry(p, x, False) for p, x in hook]
        items[name] = entry
    # host values that stay as they are (views of CPU device buffers, copies of
    # anything mutable): the writer packs them into its buffers, while the training
    # step goes on and may reuse or donate its arrays
    host = _pack.to_host(values)
    sizes, places = _pack.layout(host)
    for rec, (buf, offset, shape) in zip(recs, places, strict=True):
        rec.update(buffer=buf, offset=offset, shape=shape)
    buffers = {k: {"dtype": str(dtype), "size": int(n)}
               for k, (dtype, n) in sizes.items()}  # checksums: see _checksums
    meta = {"format": _pack.FORMAT, "step": step, "rank": rank, "world": world,
            "whole": whole, "time": time.time(), "items": items, "arrays": sorted(buffers),
            "buffers": buffers}
    # a copy: the async write serializes it later, while training mutates the state
    return host, json.loads(json.dumps(meta))


class CheckpointManager:
    """Saves and restores one training state; every rank of the job makes one.

    Args:
      directory: where the steps go; every rank must see the same directory (a local
        disk for one node, a shared file system for several).
      save_interval_steps: :meth:`save` writes at steps that are multiples of it.
      max_to_keep: how many complete steps to keep (``None``: all). Older steps are
        deleted by rank 0 once a newer one is complete on every rank.
      async_save: write in a background thread; :meth:`save` returns once the values
        are on the host (on CPU, views of the device buffers; numpy values copied) and
        the writer packs and writes them. At most one save is in flight: the next one (and
        :meth:`restore`, :meth:`wait`, :meth:`close`) waits for it first.
      elastic: allow restoring a checkpoint written by another number of processes
        (replicated state as is, samplers re-split, ZeRO shards re-partitioned).
        Without it such a directory is refused with :class:`CheckpointError`.
      reset_hook_state_on_resize: with ``elastic``, start per-replica comm-hook state
        (PowerSGD error feedback) afresh when the number of replicas changed, instead of
        raising :class:`CheckpointMismatchError`.
      timeout: seconds to wait for a write in flight before raising ``TimeoutError``.
      peer_timeout: seconds a save of values of each rank's own (samplers,
        Generators, sharded arrays) waits for every rank to call ``save`` for the
        same step before raising :class:`CheckpointError` (``None``: ``timeout``);
        a warning names the missing ranks after 5 s.
      save_on_preemption: on SIGTERM, every rank saves at its next ``save`` call, waits
        for it, and exits with status 143 (:mod:`jdist.checkpoint._preempt`). Without it
        SIGTERM ends the process, as torch's does. Needs the main thread; ``save`` must
        then be called by every rank at every step (each call is one small collective).

    Example::

      manager = CheckpointManager("/ckpt/run1", save_interval_steps=50, max_to_keep=2)
      state = manager.restore_or_init(lambda: make_training_state())
      for step in range(state["step"], total_steps):
          ...                                  # one training step
          state["step"] = step + 1
          manager.save(step + 1, state)
      manager.close()
    """

    def __init__(self, directory: str | os.PathLike, save_interval_steps: int = 1,
                 max_to_keep: int | None = None, async_save: bool = True, *,
                 elastic: bool = False, reset_hook_state_on_resize: bool = False,
                 timeout: float = 600.0, peer_timeout: float | None = None,
                 save_on_preemption: bool = False):
        if isinstance(save_interval_steps, bool) or not isinstance(
                save_interval_steps, int) or save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be an int >= 1, got "
                             f"{save_interval_steps!r}; pass e.g. save_interval_steps=50")
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(
                max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be None or an int >= 1, got {max_to_keep!r}; "
                             "a checkpoint must survive until the next one is complete")
        self.directory = os.path.abspath(os.fspath(directory))
        self.save_interval_steps = save_interval_steps
        self.max_to_keep = max_to_keep
        self.elastic = bool(elastic)
        self.reset_hook_state_on_resize = bool(reset_hook_state_on_resize)
        self.timeout = float(timeout)
        self.peer_timeout = self.timeout if peer_timeout is None else float(peer_timeout)
        self.rank, self.world = _rank_world()
        self.restart_count = restart_count()
        self.restored_step: int | None = None
        os.makedirs(self.directory, exist_ok=True)
        self._writer = Writer(async_save)
        self._closed = False
        self._preemption = (Preemption(self.rank, self._agree)
                            if save_on_preemption else None)

    # ------------------------------------------------------------------ queries
    def all_steps(self) -> list[int]:
        """Steps that every rank finished (of whichever world size wrote them)."""
        return [s.step for s in _layout.scan(self.directory)
                if s.complete_world() is not None]

    def latest_step(self) -> int | None:
        """The newest step every rank finished, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        return step % self.save_interval_steps == 0

    # ------------------------------------------------------------------ saving
    def save(self, step: int, state: dict, *, force: bool = False) -> bool:
        """Save ``state`` at ``step`` if ``step`` is on the interval (or ``force``).

        Returns whether a save started. Call it on every rank with the same steps; a
        state that holds only values every rank has whole (replicated parameters and
        optimizer state, JSON data) may also be saved by one rank alone, as torch's
        ``if rank == 0: torch.save(...)``: that rank writes a whole part, a complete
        step by itself that every rank restores.

        Raises:
          CheckpointError: ``state`` holds values of each rank's own (samplers,
            Generators, ``nnx.Rngs``, ``PerRank``) or arrays sharded over other
            processes, and not every rank called ``save`` for this step within
            ``peer_timeout`` seconds; nothing is written.
        """
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        step = int(step)
        if not isinstance(state, dict) or not state:
            raise TypeError(f"state must be a non-empty dict of named values, got "
                            f"{type(state).__name__}")
        if self._preemption is not None and self._preemption.is_stop_step():
            self._save(step, state)
            self.wait()
            self._preemption.exit(step)
        if not (force or self.should_save(step)):
            return False
        return self._save(step, state)

    def _save(self, step: int, state: dict) -> bool:
        existing = next((s for s in _layout.scan(self.directory) if s.step == step), None)
        if existing is not None and existing.complete_world() == self.world:
            self.wait()
            return False  # the step this job resumed from: already complete
        entries = _entries(state)
        why = next((w for w in (_items.not_whole(n, k, lv + hk)
                                for n, k, _, lv, hk in entries) if w), None)
        _layout.announce(self.directory, step, self.rank, self.world)
        try:
            self.wait()
            whole = _whole(self, step, why)
        except BaseException:
            _layout.withdraw(self.directory, step, self.rank, self.world)
            raise
        host, meta = _make_part(step, entries, self.rank, self.world, whole)
        _layout.remove_own(self.directory, step, self.rank, self.world)
        path = os.path.join(_layout.step_dir(self.directory, step),
                            _layout.part_name(self.rank, self.world, whole))
        self._writer.save(path, lambda spare: _pack.pack(host, spare)[0], meta,
                          prepare=_checksums, then=self._retain)
        return True

    def _retain(self) -> None:
        """Rank 0 deletes steps older than the newest ``max_to_keep`` complete ones.

        Run by the writer once this rank's part of a step is down (in its thread when
        saving asynchronously: deleting a step's files costs the training loop nothing)
        and by :meth:`close`.
        """
        if self.rank != 0:
            return
        steps = _layout.scan(self.directory)
        complete = [s.step for s in steps if s.complete_world() is not None]
        if not complete:
            return
        keep = set(complete[-self.max_to_keep:]) if self.max_to_keep else set(complete)
        newest = complete[-1]
        for s in steps:
            if s.step < newest and s.step not in keep:
                _layout.remove_step(self.directory, s.step)

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk."""
        self._writer.wait(self.timeout)

    # ------------------------------------------------------------------ restoring
    def _agree(self, code: int) -> int:
        """The largest ``code`` of all ranks (every rank calls it the same times)."""
        return _agree_max(self.world, code)

    def _candidates(self) -> list:
        steps = _layout.scan(self.directory)
        complete = [s for s in steps if s.complete_world() is not None]
        if not complete:
            started = [s for s in steps if s.parts]
            if len(started) > 1:
                raise CheckpointError(
                    f"{self.directory} holds no step that every rank finished: "
                    + _layout.Step.missing(started[-1]) + "; "
                    + "; ".join(s.missing() for s in started[-4:-1])
                    + ". It was written by another job or parts were deleted; use another "
                    "directory or remove this one to start over")
            return []
        newest = complete[-1]
        w = newest.complete_world()
        if w != self.world and not self.elastic:
            raise CheckpointError(
                f"{self.directory} holds checkpoints of a {w}-process job (newest complete "
                f"step {newest.step}, parts rank_*_of_{w:05d}) and this job has "
                f"{self.world} processes; pass elastic=True to resume on another world size, "
                "or use another directory")
        return list(reversed(complete))

    def restore(self, state: dict, step: int | None = None) -> dict:
        """``state`` restored from the newest step every rank finished (or ``step``).

        ``state`` is the template: NNX nodes, DDP wrappers and numpy Generators in it
        are restored in place; the returned dict holds those same objects, restored
        samplers and new values for pytrees and JSON data.

        Raises:
          CheckpointError: no usable step (nothing saved, ranks missing, another
            world size without ``elastic``).
          CheckpointMismatchError: the state does not fit the checkpoint (names the
            first differing path and both shapes).
          CheckpointCorruptError: no complete step could be read (each broken one is
            reported with a warning and skipped for the previous one).
        """
        self._check_open()
        self.wait()
        errors: list = []
        tried: set = set()
        while True:
            target = _agree_target(self, step, tried)
            if target < 0:
                if errors:
                    raise CheckpointCorruptError(
                        f"no complete checkpoint in {self.directory} could be read: "
                        + " | ".join(errors))
                raise CheckpointError(
                    f"{self.directory} has no complete checkpoint"
                    + ("" if step is None else f" of step {step} (complete steps: "
                       f"{self.all_steps()})"))
            tried.add(target)
            code, err, result = _try_step(self, target, state)
            agreed = self._agree(code)
            if agreed == _MISMATCH:
                raise err if err is not None else CheckpointMismatchError(
                    f"another rank found that the state does not fit step {target} of "
                    f"{self.directory} (see its error)")
            if agreed == _CORRUPT:
                msg = str(err) if err is not None else (
                    f"another rank could not read its parts of step {target}")
                warnings.warn(f"skipping checkpoint step {target}: {msg}; trying the "
                              "previous complete step", stacklevel=2)
                errors.append(msg)
                continue
            out, actions = result
            for act in actions:
                act()
            self.restored_step = target
            self._drop_newer(target)
            return out

    def _drop_newer(self, step: int | None) -> None:
        """Rank 0 removes steps newer than the one resumed (parts of a killed attempt)."""
        if self.rank != 0:
            return
        for s in _layout.scan(self.directory):
            if step is None or s.step > step:
                _layout.remove_step(self.directory, s.step)

    def restore_or_init(self, init: Callable[[], dict]) -> dict:
        """``init()``'s state, restored from the newest complete checkpoint if any.

        On the first launch this is ``init()``; after a restart (``jdist-run
        --max-restarts``) it is the state of the newest step every rank finished. The
        one line a training script needs.
        """
        state = init()
        if not isinstance(state, dict):
            raise TypeError(f"init must return a dict of named values, got "
                            f"{type(state).__name__}")
        try:
            found = 1 if self._candidates() else 0
        except CheckpointError:
            found = 1  # restore raises it on every rank
        if not self._agree(found):
            self._drop_newer(None)  # leftovers of a first save that never completed
            return state
        return self.restore(state)

    # ------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this CheckpointManager is closed; make a new one")

    def close(self) -> None:
        """Wait for the save in flight and release the writer."""
        if self._closed:
            return
        try:
            self.wait()
            self._retain()
        finally:
            self._writer.close()
            self._closed = True
            if self._preemption is not None:
                self._preemption.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"CheckpointManager({self.directory!r}, save_interval_steps="
                f"{self.save_interval_steps}, max_to_keep={self.max_to_keep}, "
                f"async_save={self._writer.async_save}, rank={self.rank}/{self.world})")


def _agree_max(world: int, code: int) -> int:
    """The largest ``code`` of all ``world`` ranks (a collective)."""
    if world == 1:
        return code
    from jdist.collectives import ReduceOp, all_reduce, is_initialized

    mine = np.array([code], np.int32)
    if not is_initialized():  # jax.distributed started without jdist
        from jax.experimental import multihost_utils

        return int(np.max(multihost_utils.process_allgather(mine)))
    return int(np.asarray(all_reduce(mine, op=ReduceOp.MAX))[0])


def _whole(m: CheckpointManager, step: int, why: str | None) -> bool:
    """Whether this rank writes the whole state (a part complete by itself).

    Rank 0 does whenever it can (it writes every replicated value anyway); another
    rank does when rank 0 is not saving this step (it waits a moment for rank 0's
    announcement, so a save on every rank writes the replicated values once). A
    state with values of each rank's own needs every rank: raise, writing nothing,
    when they do not all come.
    """
    if m.world == 1:
        return False  # its one part completes the step as it is
    if why is None and m.rank == 0:
        return True
    if why is None:
        return bool(_peers.await_ranks(m.directory, step, m.world, {0},
                                       min(m.peer_timeout, _LEAN_WAIT_S)))
    missing = _peers.await_ranks(
        m.directory, step, m.world, set(range(m.world)), m.peer_timeout,
        warn_after=min(5.0, m.peer_timeout / 2), why=why)
    if missing:
        raise CheckpointError(
            f"save(step {step}) was called on rank {m.rank} but ranks "
            f"{sorted(missing)} of {m.world} did not call it within "
            f"{m.peer_timeout:g} s, and {why}: one rank cannot save the other "
            "ranks' values, so nothing was written. Call save on every rank (not "
            "under `if rank == 0:`), or save on one rank a state of replicated "
            "values and JSON data only (parameters, optimizer state, the epoch); pass "
            "a larger peer_timeout if the other ranks are only late")
    return False


def _agree_target(m: CheckpointManager, step: int | None, tried: set) -> int:
    """The step all ranks try next: the newest one any rank sees complete (-1:
    none); an unusable directory on any rank raises on every rank."""
    err, mine = None, -1
    try:
        cands = [s.step for s in m._candidates()
                 if (step is None or s.step == step) and s.step not in tried]
        mine = cands[0] if cands else -1
    except CheckpointError as e:
        err = e
    if m._agree(1 if err is not None else 0):
        raise err if err is not None else CheckpointError(
            f"another rank cannot use {m.directory} (see its error)")
    return m._agree(mine)


def _try_step(m: CheckpointManager, target: int, state: dict) -> tuple:
    """``(code, error, (state, actions))`` of reading step ``target`` here; waits up
    to ``timeout`` for a step another rank sees complete to show here too."""
    deadline = time.monotonic() + m.timeout
    while True:
        cand = next((s for s in _layout.scan(m.directory) if s.step == target
                     and s.complete_world() is not None), None)
        if cand is not None or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    if cand is None:
        return _CORRUPT, CheckpointCorruptError(
            f"step {target} is complete on another rank, but this rank does not see it "
            f"complete in {m.directory} within {m.timeout:g} s (do all ranks see "
            "the same directory?)"), None
    reader = StepReader(cand, cand.complete_world(), m.rank)
    try:
        reader.load_all()
        return _OK, None, restore_items(
            reader, state, world=m.world, elastic=m.elastic,
            reset_hook_state_on_resize=m.reset_hook_state_on_resize)
    except CheckpointMismatchError as e:
        return _MISMATCH, e, None
    except CheckpointCorruptError as e:
        return _CORRUPT, e, None
