"""SLURM's compact host lists and task counts, expanded (pure functions, no JAX).

``node[01-04,07]`` -> ``node01 node02 node03 node04 node07``; several bracket groups
multiply (``r[1-2]n[1-2]`` -> ``r1n1 r1n2 r2n1 r2n2``); zero padding follows the
range's first bound. ``2(x3),1`` (``SLURM_STEP_TASKS_PER_NODE``) -> ``[2, 2, 2, 1]``.
"""

from __future__ import annotations

import re

__all__ = ["expand_hostlist", "expand_tasks_per_node"]


def _split_top(text: str, what: str, value: str) -> list[str]:
    """Split ``text`` on commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"{what}={value!r}: nested '[' at position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"{what}={value!r}: ']' without '[' at position {i}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"{what}={value!r}: '[' is never closed")
    parts.append(text[start:])
    return parts


def _expand_range(body: str, what: str, value: str) -> list[str]:
    out = []
    for item in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if m is None:
            raise ValueError(f"{what}={value!r}: {item!r} in [{body}] is not N or N-M")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"{what}={value!r}: range {item!r} runs backwards")
        width = len(lo)
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def _expand_one(item: str, what: str, value: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if m is None:
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", item):
            raise ValueError(f"{what}={value!r}: {item!r} is not a host name")
        return [item]
    head, tail = item[:m.start()], item[m.end():]
    return [head + n + rest for n in _expand_range(m.group(1), what, value)
            for rest in _expand_one(tail, what, value)] if tail else \
        [head + n for n in _expand_range(m.group(1), what, value)]


def expand_hostlist(value: str, what: str = "SLURM_STEP_NODELIST") -> list[str]:
    """The host names of a SLURM host list, in order.

    Raises:
      ValueError: an unparsable list; the message quotes ``what`` and ``value``.
    """
    text = value.strip()
    if not text:
        raise ValueError(f"{what}={value!r} is empty; it should name the step's nodes")
    hosts: list[str] = []
    for item in _split_top(text, what, value):
        if not item:
            raise ValueError(f"{what}={value!r}: an empty entry (two commas in a row?)")
        hosts.extend(_expand_one(item, what, value))
    return hosts


def expand_tasks_per_node(value: str, what: str = "SLURM_STEP_TASKS_PER_NODE") -> list[int]:
    """Tasks on each node, e.g. ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            raise ValueError(f"{what}={value!r}: {item!r} is not N or N(xK)")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts
