"""Communication report: the collectives a jitted program asks for, read from its HLO.

``comm_report(fn, *args)`` lowers ``fn`` (anything with ``.lower``: ``jax.jit``
functions, a DDP step) and reads the pre-optimization HLO text, so it reports what the
*program asks for*: op, dtype, element count and bytes per replica. Backends may run
something else: XLA:CPU promotes bf16 all-reduces to f32 and may combine small
all-reduces, so bf16 saves bytes only on GPU/TPU. Pass a ``Compiled`` object (or
``compiled.as_text()``) to see what a backend actually compiled.

Collectives inside ``conditional`` branches (PowerSGD's warm-up switch is one) are
listed with their branch; :attr:`CommReport.bytes_max` assumes every conditional takes
its most expensive branch and :attr:`CommReport.bytes_min` its cheapest (for PowerSGD
after ``start_powerSGD_iter``: the compressed traffic). Collectives in ``while``
bodies are counted once and flagged ``in_loop``.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Collective", "CommReport", "comm_report", "parse_hlo_collectives"]

_OPS = {
    "all-reduce": "all-reduce", "all-reduce-start": "all-reduce",
    "reduce-scatter": "reduce-scatter", "all-gather": "all-gather",
    "all-gather-start": "all-gather", "all-to-all": "all-to-all",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
    "collective-broadcast": "collective-broadcast",
}
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
          "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][a-z0-9\-]*)\((.*)$")
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?([%\w.\-]+)\s*(?:\(.*\))?.*\{\s*$")


class Collective(NamedTuple):
    """One collective in the program (sizes per replica).

    Attributes:
      op: ``all-reduce``, ``reduce-scatter``, ``all-gather``, ``all-to-all``,
        ``collective-permute`` or ``collective-broadcast``.
      dtype: element type of the operand (``f32``, ``bf16``, ...).
      elements: elements each replica sends in (the operand).
      bytes: ``elements`` times the element size.
      result_elements: elements each replica gets back.
      group_size: replicas per replica group.
      computation: the HLO computation holding it.
      branch: ``((conditional, branch_index), ...)`` from the entry, empty if unconditional.
      in_loop: whether it sits in a ``while`` body (then it runs once per iteration).
    """

    op: str
    dtype: str
    elements: int
    bytes: int
    result_elements: int
    group_size: int
    computation: str
    branch: tuple = ()
    in_loop: bool = False


def _arrays(type_text: str):
    out = []
    for dt, dims in _ARRAY.findall(type_text):
        if dt not in _BYTES:
            continue
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        out.append((dt, n))
    return out


def _group_size(attrs: str, default: int) -> int:
    m = re.search(r"replica_groups=\{\{([0-9,\s]*)\}", attrs)
    if m:
        return len([x for x in m.group(1).split(",") if x.strip()])
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", attrs)
    if m:
        return int(m.group(2))
    return default  # empty groups (all devices) or point-to-point ops


def _parse_computations(text: str):
    comps, cur, entry = {}, None, None
    for line in text.splitlines():
        if cur is None:
            m = _COMP.match(line)
            if m and not line.lstrip().startswith("HloModule"):
                cur = m.group(1).lstrip("%")
                comps[cur] = []
                if line.lstrip().startswith("ENTRY"):
                    entry = cur
            continue
        if line.strip() == "}":
            cur = None
            continue
        comps[cur].append(line)
    return comps, entry


def _callees(attrs: str):
    """(kind, [computations]) referenced by one instruction."""
    found = []
    m = re.search(r"branch_computations=\{([^}]*)\}", attrs)
    if m:
        found.append(("branches", [c.strip().lstrip("%") for c in m.group(1).split(",")]))
    tf = [re.search(rf"{k}_computation=([%\w.\-]+)", attrs) for k in ("true", "false")]
    if all(tf):  # legacy predicate form: branch 0 = true
        found.append(("branches", [tf[0].group(1).lstrip("%"), tf[1].group(1).lstrip("%")]))
    m = re.search(r"\bbody=([%\w.\-]+)", attrs)
    if m:
        found.append(("loop", [m.group(1).lstrip("%")]))
    for key in ("to_apply", "calls"):
        m = re.search(rf"\b{key}=([%\w.\-]+)", attrs)
        if m:
            found.append(("call", [m.group(1).lstrip("%")]))
    return found


def parse_hlo_collectives(text: str) -> list[Collective]:
    """Every collective reachable from the entry computation of HLO ``text``."""
    comps, entry = _parse_computations(text)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text; pass the text of an HloModule "
                         "(lowered.as_text(dialect='hlo') or compiled.as_text())")
    out: list[Collective] = []

    def walk(name, branch, in_loop, depth):
        if depth > 64:
            raise ValueError(f"HLO call graph deeper than 64 at {name!r} (recursive?)")
        shapes = {}
        for line in comps.get(name, []):
            m = _INSTR.match(line)
            if not m:
                continue
            iname, rtype, opcode, rest = m.groups()
            shapes[iname.lstrip("%")] = rtype
            if opcode in _OPS:
                out.append(_collective(opcode, rtype, rest, shapes, name, branch, in_loop))
                continue
            for kind, targets in _callees(rest):
                for bi, t in enumerate(targets):
                    if kind == "branches":
                        walk(t, branch + ((iname, bi),), in_loop, depth + 1)
                    else:
                        walk(t, branch, in_loop or kind == "loop", depth + 1)

    walk(entry, (), False, 0)
    return out


def _collective(opcode, rtype, rest, shapes, comp, branch, in_loop) -> Collective:
    op = _OPS[opcode]
    res = _arrays(rtype)
    operands = re.match(r"([^)]*)\)", rest).group(1)
    ops_types = []
    for tok in operands.split(","):
        tok = tok.strip()
        if not tok:
            continue
        if "[" in tok:  # typed operand "f32[4]{0} %x"
            ops_types.extend(_arrays(tok))
        else:
            ops_types.extend(_arrays(shapes.get(tok.lstrip("%"), "")))
    if opcode.endswith("-start"):  # async start results hold operand and result buffers
        res = res[len(res) // 2:] if len(res) > 1 else res
    dtype = (ops_types or res or [("?", 0)])[0][0]
    elems = sum(n for _, n in ops_types) if ops_types else sum(n for _, n in res)
    nbytes = sum(n * _BYTES[d] for d, n in ops_types) if ops_types else sum(
        n * _BYTES[d] for d, n in res)
    res_elems = sum(n for _, n in res)
    gsize = _group_size(rest, max(1, res_elems // max(elems, 1)))
    return Collective(op, dtype, int(elems), int(nbytes), int(res_elems), gsize, comp,
                      branch, in_loop)


class CommReport(NamedTuple):
    """The collectives of one program and byte totals (per replica, per call)."""

    collectives: tuple[Collective, ...]
    source: str

    @property
    def count(self) -> int:
        """Number of collectives in the program (all branches)."""
        return len(self.collectives)

    def _total(self, pick) -> int:
        plain = sum(c.bytes for c in self.collectives if not c.branch)
        by_cond: dict = {}
        for c in self.collectives:
            if c.branch:
                cond, bi = c.branch[0]
                by_cond.setdefault(cond, {}).setdefault(bi, 0)
                by_cond[cond][bi] += c.bytes
        return plain + sum(pick(v.values()) if len(v) > 1 else pick(list(v.values()) + [0])
                           for v in by_cond.values())

    @property
    def bytes_max(self) -> int:
        """Bytes if every conditional takes its most expensive branch."""
        return self._total(max)

    @property
    def bytes_min(self) -> int:
        """Bytes if every conditional takes its cheapest branch."""
        return self._total(min)

    @property
    def bytes(self) -> int:
        """Total bytes of a program without conditionals (else raises; use min/max)."""
        if any(c.branch for c in self.collectives):
            raise ValueError("this program has collectives inside conditionals; read "
                             "bytes_min / bytes_max (or filter .collectives by branch)")
        return self.bytes_max

    def by_op(self) -> dict:
        """``{(op, dtype): (count, bytes)}`` over all collectives."""
        out: dict = {}
        for c in self.collectives:
            n, b = out.get((c.op, c.dtype), (0, 0))
            out[(c.op, c.dtype)] = (n + 1, b + c.bytes)
        return out

    def table(self) -> str:
        """A printable table, one row per collective, then the totals."""
        rows = [f"{'op':<20}{'dtype':<7}{'elements':>12}{'bytes':>14}  where"]
        for c in self.collectives:
            where = " ".join(f"{n}[{b}]" for n, b in c.branch) or "-"
            rows.append(f"{c.op:<20}{c.dtype:<7}{c.elements:>12}{c.bytes:>14}  {where}"
                        + ("  (loop)" if c.in_loop else ""))
        rows.append(f"{len(self.collectives)} collectives; bytes per replica per call: "
                    f"min {self.bytes_min}, max {self.bytes_max} ({self.source})")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def comm_report(fn: Any, *args, **kwargs) -> CommReport:
    """The collectives ``fn(*args, **kwargs)`` asks for, with dtypes and bytes.

    Args:
      fn: a jitted function (or anything with ``.lower``), a ``Lowered``, a
        ``Compiled``, or HLO module text.
      *args: example arguments (arrays or ``jax.ShapeDtypeStruct``) when ``fn`` must be
        lowered.
      **kwargs: keyword arguments for ``fn.lower``.

    Returns:
      A :class:`CommReport`. Sizes are per replica (inside ``shard_map`` shapes are
      local); bytes are what each replica feeds into the collective.
    """
    if isinstance(fn, str):
        return CommReport(tuple(parse_hlo_collectives(fn)), "hlo text")
    if hasattr(fn, "lower") and not hasattr(fn, "compile"):
        fn = fn.lower(*args, **kwargs)
    elif not hasattr(fn, "as_text"):
        raise TypeError(f"comm_report expects a jitted function, Lowered, Compiled or HLO "
                        f"text, got {type(fn).__name__}; wrap plain functions in jax.jit first")
    elif args or kwargs:
        raise TypeError(f"arguments given, but {type(fn).__name__} is already lowered/compiled")
    if hasattr(fn, "compile"):  # Lowered: what the program asks for
        return CommReport(tuple(parse_hlo_collectives(fn.as_text(dialect="hlo"))), "lowered")
    if hasattr(fn, "as_text"):  # Compiled: what this backend will run
        return CommReport(tuple(parse_hlo_collectives(fn.as_text())), "compiled")
    raise TypeError(f"comm_report expects a jitted function, Lowered, Compiled or HLO text, "
                    f"got {type(fn).__name__}; wrap plain functions in jax.jit first")
