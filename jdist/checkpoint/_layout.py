"""Where the parts of a checkpoint live, and which steps every rank finished (no JAX).

One step is a directory ``step_<8 digits>`` holding one Orbax checkpoint per rank,
``rank_<r>_of_<world>``. Orbax writes each part under a temporary name and renames it
when every byte is down, so a part under its final name is complete; a step is
complete when the parts of all ``world`` ranks are there. Each rank only ever writes,
replaces and deletes its own parts, so the ranks agree through the file system (a
directory all ranks see, as with any multi-host checkpoint) without messages.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil

__all__ = ["Step", "part_name", "scan", "remove_own", "remove_step", "step_dir"]

_STEP = re.compile(r"^step_(\d{8,})$")
_PART = re.compile(r"^rank_(\d{5,})_of_(\d{5,})$")
_TMP = ".orbax-checkpoint-tmp"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def part_name(rank: int, world: int) -> str:
    return f"rank_{rank:05d}_of_{world:05d}"


@dataclasses.dataclass
class Step:
    """The finished parts of one step: ``parts[world] = {rank: path}``."""

    step: int
    path: str
    parts: dict
    temporary: list  # parts still under Orbax's temporary name (a write in flight or cut)

    def complete_world(self) -> int | None:
        """The world size whose every rank finished this step (None if none did)."""
        done = [w for w, ranks in self.parts.items() if set(ranks) == set(range(w))]
        return max(done) if done else None

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
                if rank < world:
                    parts.setdefault(world, {})[rank] = os.path.join(path, entry)
        steps.append(Step(int(m.group(1)), path, parts, tmp))
    return sorted(steps, key=lambda s: s.step)


def remove_own(root: str, step: int, rank: int, world: int) -> None:
    """Delete this rank's part of ``step`` (and its temporary leftovers), if any.

    The step directory stays (another rank may be starting its part in it right now);
    rank 0 removes whole steps when they are no longer needed.
    """
    path = step_dir(root, step)
    name = part_name(rank, world)
    for entry in (name, name + _TMP):
        shutil.rmtree(os.path.join(path, entry), ignore_errors=True)


def remove_step(root: str, step: int) -> None:
    """Delete a whole step directory (rank 0 does this for steps nobody may read)."""
    shutil.rmtree(step_dir(root, step), ignore_errors=True)
