"""Reading one complete step back into a training state (after the ranks agreed on it).

:class:`StepReader` loads the parts this rank needs (every rank's small JSON record;
the buffers of rank 0, of this rank, and of the ranks holding shards it needs),
checks every buffer's checksum, and :func:`restore_items` builds the new state, checking
names, shapes and dtypes against the state given as the template before anything is
written into it.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np

from jdist.checkpoint import _items, _leaves, _pack
from jdist.checkpoint._elastic import resume_sampler
from jdist.checkpoint._errors import CheckpointCorruptError, CheckpointMismatchError
from jdist.checkpoint._orbax import read_part

__all__ = ["StepReader", "restore_items"]


class StepReader:
    """The parts of one complete step, read lazily and checked."""

    def __init__(self, step, world: int, rank: int):
        self.step = step
        self.world = world
        self.rank = rank
        # every rank's part, or one part holding the whole state (saved by one rank)
        self.paths, self.whole_rank = step.readable(world)
        self.ranks = sorted(self.paths)
        whole = self.whole_rank is not None
        self.primary = self.whole_rank if whole else 0  # the replicated values' part
        self.own = self.whole_rank if whole else (rank if rank < world else None)
        self._meta: dict = {}
        self._arrays: dict = {}
        self._checked: set = set()  # (rank, buffer) whose checksum matched

    def _guard(self, r: int, what: str, fn):
        try:
            return fn()
        except (CheckpointCorruptError, CheckpointMismatchError):
            raise
        except Exception as e:  # orbax/tensorstore raise many types for a broken file
            raise CheckpointCorruptError(
                f"cannot read {what} of the checkpoint part {self.paths[r]} (step "
                f"{self.step.step}, rank {r} of {self.world}): {type(e).__name__}: "
                f"{str(e)[:400]}") from e

    def meta(self, r: int) -> dict:
        if r not in self._meta:
            m = self._guard(r, "the JSON record", lambda: read_part(self.paths[r], False)[1])
            if not isinstance(m, dict) or not _pack.record_ok(m):
                raise CheckpointCorruptError(
                    f"the JSON record of the checkpoint part {self.paths[r]} (step "
                    f"{self.step.step}, rank {r} of {self.world}) fails its checksum (the file "
                    "meta/metadata was changed or cut after it was written)")
            if m.get("format") not in _pack.READABLE:
                raise CheckpointCorruptError(
                    f"the checkpoint part {self.paths[r]} has format {m.get('format')!r} and "
                    f"this jdist.checkpoint reads formats {list(_pack.READABLE)}; restore it "
                    "with the jdist version that wrote it, or start from another directory")
            if m.get("step") != self.step.step or m.get("rank") != r or m.get(
                    "world") != self.world:
                raise CheckpointCorruptError(
                    f"the checkpoint part {self.paths[r]} records step {m.get('step')}, "
                    f"rank {m.get('rank')} of {m.get('world')}: not what its name says")
            self._meta[r] = m
        return self._meta[r]

    def arrays(self, r: int) -> dict:
        if r not in self._arrays:
            m = self.meta(r)
            names = m.get("arrays", [])
            got = self._guard(r, "the arrays", lambda: read_part(self.paths[r], True, names)[0])
            missing = sorted(set(names) - set(got))
            if missing:
                raise CheckpointCorruptError(
                    f"the checkpoint part {self.paths[r]} lacks arrays {missing[:5]}")
            self._arrays[r] = got
        return self._arrays[r]

    def piece(self, r: int, piece: dict, where: str) -> np.ndarray:
        name = piece["buffer"]
        buf = self.arrays(r)[name]
        if (r, name) not in self._checked:
            rec = self.meta(r)["buffers"][name]
            if buf.shape != (rec["size"],) or buf.dtype.name != rec["dtype"] or \
                    not _pack.checksum_ok(buf, rec):
                raise CheckpointCorruptError(
                    f"{where}: the buffer {name!r} in the checkpoint part {self.paths[r]} "
                    f"(step {self.step.step}) fails its checksum (the file was changed "
                    "or cut after it was written)")
            self._checked.add((r, name))
        try:
            return _pack.piece_of(buf, piece["offset"], piece["shape"])
        except ValueError as e:
            raise CheckpointCorruptError(f"{where}: the checkpoint part {self.paths[r]}: "
                                         f"{e}") from None

    def load_all(self) -> None:
        """Read and check everything this rank will need (so a broken part fails here)."""
        for r in self.ranks:
            self.meta(r)
        for r in self._needed_ranks():
            m = self.meta(r)
            for name, entry in m["items"].items():
                for leaf in entry.get("leaves", []) + entry.get("hook", []):
                    for p in leaf["pieces"]:
                        self.piece(r, p, f"state[{name!r}] {leaf['path']!r}")

    def _needed_ranks(self) -> list[int]:
        ranks = {self.primary}
        if self.own is not None:
            ranks.add(self.own)
        for r in self.ranks:
            for entry in self.meta(r)["items"].values():
                if any(leaf["place"] == "sharded" and leaf["pieces"]
                       for leaf in entry.get("leaves", []) + entry.get("hook", [])):
                    ranks.add(r)
        return sorted(ranks)

    def value(self, name: str, i: int, key: str = "leaves") -> np.ndarray:
        """The host value of leaf ``i`` of item ``name`` (``key``: leaves or hook)."""
        own = self.primary if self.own is None else self.own
        info = self.meta(own)["items"][name][key][i]
        where = f"state[{name!r}] {info['path']!r}"
        if info["place"] == "local":
            return self.piece(own, info["pieces"][0], where)
        if info["place"] == "replicated":
            p = self.primary
            return self.piece(p, self.meta(p)["items"][name][key][i]["pieces"][0], where)
        pieces = []
        for r in self.ranks:
            rinfo = self.meta(r)["items"][name][key][i]
            pieces += [(p["index"], self.piece(r, p, where)) for p in rinfo["pieces"]]
        return _leaves.assemble(tuple(info["shape"]), np.dtype(info["dtype"]), pieces, where)


def _state_resizer(value: Any) -> Any:
    """The optimizer's ``resize_state_leaf(saved, length)`` when ``value`` is an
    ``nnx.Optimizer`` whose transformation stores flat sharded state that can be re-split
    for another number of replicas (ZeroRedundancyOptimizer), else ``None``."""
    return getattr(getattr(value, "tx", None), "resize_state_leaf", None)


def _restore_arrays(reader: StepReader, name: str, kind: str, value: Any, saved: list,
                    leaves: list) -> list:
    resize = _state_resizer(value) if kind == "nnx" else None

    def resizable(path, s, t):
        return (resize is not None and len(s["shape"]) == 1 and len(t["shape"]) == 1
                and s["place"] == "sharded")

    _items.check_leaves(name, saved, leaves, resizable)
    out = []
    for (path, template), info, i in zip(leaves, saved, range(len(saved)), strict=True):
        host = reader.value(name, i)
        want = _leaves.describe(template)["shape"]
        if list(host.shape) != list(want):
            try:
                host = resize(host, want[0])
            except ValueError as e:
                raise CheckpointMismatchError(f"state[{name!r}] {path!r}: {e}") from e
        out.append(_leaves.place(host, template, info))
    return out


def _hook_loader(reader: StepReader, name: str, ddp, saved: list, reset: bool):
    """A loader for ``ddp.load_replica_hook_state`` (None: keep the fresh state)."""
    if not saved:
        return None
    saved_replicas = reader.meta(reader.primary)["items"][name].get("num_replicas")
    now = ddp.process_group.num_replicas
    if saved_replicas != now:
        if reset:
            warnings.warn(f"state[{name!r}]: the comm hook's per-replica state was saved for "
                          f"{saved_replicas} replicas and this job has {now}; it starts "
                          "afresh (reset_hook_state_on_resize=True)", stacklevel=4)
            return None
        raise CheckpointMismatchError(
            f"state[{name!r}]: the comm hook's per-replica state (PowerSGD error feedback) "
            f"was saved for {saved_replicas} replicas and this job has {now}; it cannot be "
            "split for another number of replicas. Pass reset_hook_state_on_resize=True to "
            "start it afresh, or restore on the saving world size")
    values = [reader.value(name, i, "hook") for i in range(len(saved))]

    def load(state):
        leaves = [(_leaves.key_path(p), x)
                  for p, x in jax.tree_util.tree_flatten_with_path(state)[0]]
        _items.check_leaves(f"{name}.comm_hook_state", saved, leaves)
        new = [_leaves.place(v, t, info)
               for v, (_, t), info in zip(values, leaves, saved, strict=True)]
        return jax.tree.unflatten(jax.tree.structure(state), new)

    return load


def restore_items(reader: StepReader, state: dict, *, world: int, elastic: bool,
                  reset_hook_state_on_resize: bool) -> tuple[dict, list]:
    """``(new state, actions)``: the restored values, and the in-place writes to run
    once every item checked out (so a mismatch leaves the given state untouched)."""
    own = reader.own
    meta = reader.meta(own if own is not None else reader.primary)
    # a state saved whole (replicated values and JSON data only) restores the JSON
    # values of the part that holds it on every rank, as a torch.load of rank 0's
    # snapshot does, however many ranks' parts are there
    saved_whole = bool(reader.meta(reader.primary).get("whole"))
    json_rank = reader.primary if saved_whole else own
    saved_items = meta["items"]
    missing = sorted(set(saved_items) - set(state))
    extra = sorted(set(state) - set(saved_items))
    if missing or extra:
        raise CheckpointMismatchError(
            f"the checkpoint of step {reader.step.step} holds the state entries "
            f"{sorted(saved_items)}, the restore target {sorted(state)} (missing from the "
            f"target: {missing}, not in the checkpoint: {extra}); pass the same entries as "
            "the saving run")
    out, actions = dict(state), []
    per_rank = sorted(n for n, e in saved_items.items()
                      if e["kind"] in ("np_rng", "per_rank", "rngs", "json"))
    if reader.rank == 0 and world < reader.world and per_rank and not saved_whole:
        warnings.warn(f"the checkpoint was saved by {reader.world} ranks and this job has "
                      f"{world}: the per-rank values {per_rank} of ranks {world}.."
                      f"{reader.world - 1} are not restored anywhere", stacklevel=4)
    for name, value in state.items():
        kind = _items.kind_of(name, value)
        entry = saved_items[name]
        if entry["kind"] != kind:
            raise CheckpointMismatchError(
                f"state[{name!r}] was saved as a {entry['kind']} value and the restore target "
                f"is a {kind} value ({type(value).__name__})")
        if kind == "sampler":
            states = [reader.meta(r)["items"][name]["json"] for r in range(reader.world)]
            actions.append(lambda n=name, v=value, s=states: out.__setitem__(
                n, resume_sampler(v, s, min(reader.rank, len(s) - 1), len(s), n, elastic)))
            continue
        if kind == "json":
            # this rank's value; a rank new to the world takes rank 0's (the step, ...)
            src = reader.primary if json_rank is None else json_rank
            out[name] = reader.meta(src)["items"][name]["json"]
            continue
        if kind in ("np_rng", "per_rank", "rngs"):
            if own is None:
                warnings.warn(f"state[{name!r}] is per rank and the checkpoint has no rank "
                              f"{reader.rank} (saved by {reader.world} ranks): this rank keeps "
                              "the value init gave it", stacklevel=4)
                continue
        if kind == "np_rng":
            actions.append(lambda v=value, s=entry["json"]: setattr(v.bit_generator,
                                                                     "state", s))
            continue
        leaves = _items.array_leaves(kind, value)
        new = _restore_arrays(reader, name, kind, value, entry["leaves"], leaves)
        if kind in ("nnx", "rngs", "ddp"):
            actions.append(lambda k=kind, v=value, x=new: _items.rebuild(k, v, x))
        else:
            out[name] = _items.rebuild(kind, value, new)
        if kind == "ddp":
            if entry.get("hook") and value.comm_hook_state is None:
                raise CheckpointMismatchError(
                    f"state[{name!r}] was saved with a comm hook's state; register the same "
                    "hook (comm_hook=... or register_comm_hook) before restoring")
            loader = _hook_loader(reader, name, value, entry.get("hook", []),
                                  reset_hook_state_on_resize)
            if loader is not None:
                actions.append(lambda v=value, f=loader: v.load_replica_hook_state(f))
    return out, actions
