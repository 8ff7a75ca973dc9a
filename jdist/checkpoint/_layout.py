"""Where the parts of a checkpoint live, and which steps every rank finished (no JAX).

One step is a directory ``step_<8 digits>`` holding one Orbax checkpoint per rank,
``rank_<r>_of_<world>``. Orbax writes each part under a temporary name and renames it
when every byte is down, so a part under its final name is complete; a step is
complete when the parts of all ``world`` ranks are there. Each rank only ever writes,
replaces and deletes its own parts, so the ranks agree through the file system (a
directory all ranks see, as with any multi-host checkpoint) without messages.

A part named ``rank_<r>_of_<world>.whole`` holds the whole state (every value was
replicated or addressable on its writer: a save called on one rank, as
``if rank == 0: torch.save(...)``); it completes its step alone unless another rank
announced a part of that step (``rank_<r>_of_<world>.arrived``, an empty file each
saving rank makes first), which then has to be there too.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil

__all__ = ["Step", "part_name", "scan", "remove_own", "remove_step", "step_dir",
           "announce", "withdraw", "arrived"]

_STEP = re.compile(r"^step_(\d{8,})$")
_PART = re.compile(r"^rank_(\d{5,})_of_(\d{5,})(\.whole|\.arrived)?$")
_TMP = ".orbax-checkpoint-tmp"
_WHOLE, _ARRIVED = ".whole", ".arrived"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def part_name(rank: int, world: int, whole: bool = False) -> str:
    return f"rank_{rank:05d}_of_{world:05d}" + (_WHOLE if whole else "")


@dataclasses.dataclass
class Step:
    """The finished parts of one step: ``parts[world] = {rank: path}``; ``whole``
    the same for the parts that hold the whole state, ``announced[world]`` the ranks
    that started a part of it."""

    step: int
    path: str
    parts: dict
    temporary: list  # parts still under Orbax's temporary name (a write in flight or cut)
    whole: dict = dataclasses.field(default_factory=dict)
    announced: dict = dataclasses.field(default_factory=dict)

    def _complete(self, w: int) -> bool:
        have = set(self.parts.get(w, {}))
        if have == set(range(w)):
            return True
        return bool(self.whole.get(w)) and self.announced.get(w, set()) <= have

    def complete_world(self) -> int | None:
        """The world size whose every rank finished this step, or whose whole part
        stands alone (None if none)."""
        done = [w for w in self.parts if self._complete(w)]
        return max(done) if done else None

    def readable(self, world: int) -> tuple[dict, int | None]:
        """``({rank: path}, whole_rank)``: the parts a restore reads; ``whole_rank`` is
        the rank of the one whole part read alone (None: every rank's part)."""
        parts = self.parts[world]
        if set(parts) == set(range(world)):
            return dict(parts), None
        r = min(self.whole[world])
        return {r: self.whole[world][r]}, r

    def missing(self) -> str:
        """What is missing, in words (for error messages)."""
        if not self.parts:
            return f"step {self.step}: no finished part"
        out = []
        for w, ranks in sorted(self.parts.items()):
            lost = sorted(set(range(w)) - set(ranks))
            out.append(f"step {self.step} has the parts of ranks {sorted(ranks)} of a "
                       f"{w}-process job, missing ranks {lost}")
        return "; ".join(out)


def scan(root: str) -> list[Step]:
    """Every step under ``root``, oldest first (an absent ``root`` has none)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    steps = []
    for name in names:
        m = _STEP.match(name)
        if not m:
            continue
        path = os.path.join(root, name)
        parts: dict = {}
        whole: dict = {}
        announced: dict = {}
        tmp = []
        try:
            entries = os.listdir(path)
        except FileNotFoundError:  # removed meanwhile by its owner
            continue
        for entry in entries:
            if entry.endswith(_TMP):
                tmp.append(entry)
                continue
            pm = _PART.match(entry)
            if pm:
                rank, world = int(pm.group(1)), int(pm.group(2))
                if rank >= world:
                    continue
                if pm.group(3) == _ARRIVED:
                    announced.setdefault(world, set()).add(rank)
                    continue
                parts.setdefault(world, {})[rank] = os.path.join(path, entry)
                if pm.group(3) == _WHOLE:
                    whole.setdefault(world, {})[rank] = parts[world][rank]
        steps.append(Step(int(m.group(1)), path, parts, tmp, whole, announced))
    return sorted(steps, key=lambda s: s.step)


def remove_own(root: str, step: int, rank: int, world: int) -> None:
    """Delete this rank's part of ``step`` (and its temporary leftovers), if any.

    The step directory stays (another rank may be starting its part in it right now);
    rank 0 removes whole steps when they are no longer needed.
    """
    path = step_dir(root, step)
    for name in (part_name(rank, world), part_name(rank, world, True)):
        for entry in (name, name + _TMP):
            shutil.rmtree(os.path.join(path, entry), ignore_errors=True)


def announce(root: str, step: int, rank: int, world: int) -> None:
    """Mark that ``rank`` is saving a part of ``step`` (before it decides what to write)."""
    path = step_dir(root, step)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, part_name(rank, world) + _ARRIVED), "w"):
        pass


def withdraw(root: str, step: int, rank: int, world: int) -> None:
    """Undo :func:`announce` (a save that raised before writing anything); the step
    directory goes too if nothing else is in it."""
    path = step_dir(root, step)
    try:
        os.remove(os.path.join(path, part_name(rank, world) + _ARRIVED))
        os.rmdir(path)
    except OSError:  # another rank's files are there, or it is gone already
        pass


def arrived(root: str, step: int, world: int) -> set:
    """The ranks (of a ``world``-process job) that announced a part of ``step``."""
    try:
        entries = os.listdir(step_dir(root, step))
    except FileNotFoundError:
        return set()
    out = set()
    for entry in entries:
        pm = _PART.match(entry)
        if pm and pm.group(3) == _ARRIVED and int(pm.group(2)) == world:
            out.add(int(pm.group(1)))
    return out


def remove_step(root: str, step: int) -> None:
    """Delete a whole step directory (rank 0 does this for steps nobody may read)."""
    shutil.rmtree(step_dir(root, step), ignore_errors=True)
