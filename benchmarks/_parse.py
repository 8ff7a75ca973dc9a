"""Results of the benchmarks, read from what they printed (pure functions, no I/O).

A benchmark reports its numbers in one of two ways:

- a machine-readable line ``BENCH_JSON {...}`` (see :func:`bench_json`), printed next to
  its human table from the same values;
- only its human table, which a per-benchmark text parser here reads back.

Either way the result is a :class:`Parsed`: tables of rows ``case, unit, jdist,
baseline, ratio, note`` (a ratio the benchmark printed is kept as printed; one it did
not print is computed from the two printed numbers and marked ``computed``) and
``series`` for the plots.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import NamedTuple

MARK = "BENCH_JSON "
NUM = r"[-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|nan|inf"


class Parsed(NamedTuple):
    """What was read from one benchmark's output.

    Attributes:
        tables: ``[{"title", "subject", "baseline", "ratio", "rows": [{"case", "unit",
            "jdist", "baseline", "ratio", "note"}]}]``; ``subject`` and ``baseline`` name
            the two columns (``subject`` is jdist unless said otherwise) and ``ratio``
            says how the ratio is defined.
        series: plot data (``allreduce``, ``ddp``, ``rpc``), absent keys when none.
        source: ``"BENCH_JSON"``, ``"text"`` or ``"none"`` (nothing recognised).
    """

    tables: list
    series: dict
    source: str


def num(text: str) -> float:
    """A printed number (``1,234.5``, ``1.2e-3``, ``nan``) as a float."""
    return float(text.replace(",", ""))


def row(case: str, unit: str, jdist: float, baseline: float, ratio: float | None = None,
        note: str = "") -> dict:
    """One table row; a missing ``ratio`` is ``jdist / baseline``, marked as computed."""
    if ratio is None:
        ratio = jdist / baseline if baseline else float("nan")
        note = "; ".join(x for x in (note, "ratio computed") if x)
    return {"case": case, "unit": unit, "jdist": jdist, "baseline": baseline,
            "ratio": ratio, "note": note}


def table(title: str, baseline: str, ratio: str, rows: list, subject: str = "jdist") -> dict:
    """One table: its rows compare ``subject`` (jdist unless said otherwise) with the
    column named ``baseline``; ``ratio`` says how the ratio is defined."""
    return {"title": title, "subject": subject, "baseline": baseline, "ratio": ratio,
            "rows": rows}


def bench_json(bench: str, tables: list, series: dict | None = None) -> str:
    """The ``BENCH_JSON`` line a benchmark prints (one line, no newline)."""
    return MARK + json.dumps({"bench": bench, "tables": tables, "series": series or {}},
                             allow_nan=True)


def from_json_lines(output: str) -> Parsed | None:
    """Every ``BENCH_JSON`` line of ``output`` merged (tables appended), or None."""
    tables: list = []
    series: dict = {}
    found = False
    for line in output.splitlines():
        if not line.startswith(MARK):
            continue
        try:
            data = json.loads(line[len(MARK):])
        except json.JSONDecodeError as e:
            raise ValueError(f"bad BENCH_JSON line {line[:120]!r}: {e}; print it with "
                             f"benchmarks._parse.bench_json") from e
        found = True
        tables += data.get("tables", [])
        series.update(data.get("series", {}))
    return Parsed(tables, series, "BENCH_JSON") if found else None


# --------------------------------------------------------------------- text parsers
def _lines(output: str) -> list[str]:
    return [ln.rstrip() for ln in output.splitlines()]


def parse_ddp(output: str) -> Parsed:
    """benchmarks/ddp.py: (a) overhead vs hand-written, (b) vs torch DDP, (c) compile."""
    over, comp, vs, attr = [], [], [], []
    series: dict = {}
    hand = model = None
    for ln in _lines(output):
        m = re.match(rf"\s+hand-written.*?\s({NUM}) ms\s+compile ({NUM}) s\s*$", ln)
        if m:
            hand = (num(m[1]), num(m[2]))
            continue
        m = re.match(rf"\s+(\S.*?)\s+({NUM}) ms\s+compile ({NUM}) s\s+ratio ({NUM})x"
                     rf"\s+compile ratio ({NUM})x", ln)
        if m and hand:
            over.append(row(m[1], "ms", num(m[2]), hand[0], num(m[4])))
            comp.append(row(f"{m[1]}, first step", "s", num(m[3]), hand[1], num(m[5])))
            continue
        m = re.match(rf"\s+(\w+): torch DDP\s+({NUM}) ms", ln)
        if m:
            model = m[1]
            series.setdefault("ddp", {})[model] = {"torch DDP": num(m[2])}
            continue
        m = re.match(rf"\s+(\S.*?)\s+({NUM}) ms\s+ratio ({NUM})x\s+\(first step ({NUM}) s\)",
                     ln)
        if m and model:
            torch_ms = series["ddp"][model]["torch DDP"]
            series["ddp"][model][m[1]] = num(m[2])
            vs.append(row(f"{model}: {m[1]}", "ms", num(m[2]), torch_ms, num(m[3]),
                          f"first step {m[4]} s"))
            continue
        m = re.search(rf"compute only.*torch\s+({NUM}) ms\s+JAX\s+({NUM}) ms\s+ratio ({NUM})x",
                      ln)
        if m and model:
            attr.append(row(f"{model}: plain JAX step", "ms", num(m[2]), num(m[1]), num(m[3]),
                            "1 process, 1 device, no communication"))
    tables = []
    if over:
        tables.append(table("(a) DDP step, one process: jdist vs a hand-written "
                            "jit(shard_map) + pmean step", "hand-written",
                            "jdist / hand-written (lower is better; goal <= 1.05)", over))
    if vs:
        tables.append(table("(b) DDP step, 2 processes (gloo): jdist vs torch DDP",
                            "torch DDP", "jdist / torch (lower is better)", vs))
    if attr:
        tables.append(table("(b) attribution: compute only, no communication",
                            "torch", "JAX / torch", attr, subject="plain JAX"))
    if comp:
        tables.append(table("(c) first step (trace + compile)", "hand-written",
                            "jdist / hand-written", comp))
    return Parsed(tables, series, "text" if tables else "none")


def parse_dp(output: str) -> Parsed:
    """benchmarks/dp.py: DataParallel against one device and against the SPMD floor."""
    v: dict = {}
    section = "big"
    for ln in _lines(output):
        if ln.startswith("tiny MLP"):
            section = "tiny"
        m = re.match(rf"\s+(.+?):\s+({NUM}) ms", ln)
        if m:
            v[(section, m[1].strip())] = num(m[2])
        m = re.match(rf"\s+ratio DataParallel / one device:\s+({NUM})x", ln)
        if m:
            v[("big", "ratio")] = num(m[1])
    one = v.get(("big", "one device (jit)"))
    dp_ms = next((x for (s, k), x in v.items() if s == "big" and k.startswith("DataParallel")),
                 None)
    floor = next((x for (s, k), x in v.items() if s == "big" and "floor" in k), None)
    rows = []
    if one is not None and dp_ms is not None:
        rows.append(row("DataParallel vs one device (jit)", "ms", dp_ms, one,
                        v.get(("big", "ratio")), "goal <= 1.5 on 2 cores"))
    if floor is not None and dp_ms is not None:
        rows.append(row("DataParallel vs one jitted SPMD program (floor)", "ms", dp_ms, floor))
    t_one = v.get(("tiny", "one device (jit)"))
    if t_one is not None:
        for (s, k), x in v.items():
            if s == "tiny" and k != "one device (jit)":
                rows.append(row(f"tiny MLP: {k}", "ms", x, t_one))
    tables = [table("DataParallel forward+backward", "baseline",
                    "jdist / baseline (lower is better)", rows)] if rows else []
    return Parsed(tables, {}, "text" if rows else "none")


def parse_hooks(output: str) -> Parsed:
    """benchmarks/hooks_optim.py: bytes per step per comm hook; ZeRO-1 vs plain DP."""
    hooks, steps, mem = [], {}, {}
    base = None
    zero_ratio = {}
    for ln in _lines(output):
        m = re.match(rf"(\S.*?)\s+({NUM})\s+({NUM})\s+({NUM})\s+(\d+)\s*$", ln)
        if m and not ln.startswith(("plain", "ZeRO", "DDP")):
            asked = num(m[2])
            base = asked if base is None else base
            hooks.append(row(m[1], "bytes", asked, base, num(m[3]),
                             f"compiled (CPU) {m[4]} bytes, {m[5]} collectives"))
            continue
        m = re.match(rf"((?:plain|ZeRO|DDP).*?)\s+({NUM})\s+({NUM})\s*$", ln)
        if m:
            steps[m[1]] = num(m[2])
            mem[m[1]] = num(m[3])
            continue
        m = re.match(rf"ZeRO / plain: time x({NUM}), state memory x({NUM})", ln)
        if m:
            zero_ratio = {"time": num(m[1]), "mem": num(m[2])}
    tables = []
    if hooks:
        # the printed ratio is no-hook bytes / hook bytes: the compression factor
        tables.append(table("Bytes per replica per DDP step (lowered program)", "no hook",
                            "no hook / hook (compression; higher is better)", hooks))
    plain = next((k for k in steps if k.startswith("plain")), None)
    zero = next((k for k in steps if k.startswith("ZeRO")), None)
    ddp = next((k for k in steps if k.startswith("DDP")), None)
    rows = []
    if plain and zero:
        rows.append(row(f"step time: {zero}", "ms", steps[zero], steps[plain],
                        zero_ratio.get("time")))
        rows.append(row(f"optimizer state per replica: {zero}", "bytes", mem[zero], mem[plain],
                        zero_ratio.get("mem")))
    if plain and ddp:
        rows.append(row(f"step time: {ddp}", "ms", steps[ddp], steps[plain]))
    if rows:
        tables.append(table("Adam step: ZeRO-1 and DDP vs plain data parallel",
                            "plain DP (all-reduce + Adam)", "jdist / plain DP", rows))
    return Parsed(tables, {}, "text" if tables else "none")


def parse_rpc(output: str) -> Parsed:
    """benchmarks/rpc.py: latency and throughput of jdist, torch RPC and a raw socket."""
    lat, cpu_call, tp, cpu_echo, ratios = {}, {}, {}, {}, {}
    for ln in _lines(output):
        m = re.match(rf"\s+(jdist|torch|raw)\s+latency\s+({NUM}) us\s+CPU\s+({NUM}) us/call", ln)
        if m:
            lat[m[1]], cpu_call[m[1]] = num(m[2]), num(m[3])
            continue
        m = re.match(rf"\s+(jdist|torch|raw)\s+({NUM}) GB/s\s+CPU\s+({NUM}) ms/echo", ln)
        if m:
            tp[m[1]], cpu_echo[m[1]] = num(m[2]), num(m[3])
            continue
        for key, pat in (("lat", rf"latency\s+jdist/torch = ({NUM})"),
                         ("cpu_call", rf"CPU per call jdist/torch = ({NUM})"),
                         ("tp", rf"throughput jdist/torch = ({NUM})"),
                         ("cpu_echo", rf"CPU per echo jdist/torch = ({NUM})"),
                         ("tp_raw", rf"throughput jdist/raw socket = ({NUM})"),
                         ("cpu_raw", rf"CPU per echo jdist/raw = ({NUM})")):
            m = re.search(pat, ln)
            if m:
                ratios[key] = num(m[1])
    tables, series = [], {}
    if {"jdist", "torch"} <= lat.keys() and {"jdist", "torch"} <= tp.keys():
        tables.append(table("rpc_sync vs torch.distributed.rpc (TensorPipe)", "torch",
                            "jdist / torch (latency, CPU: lower is better; throughput: "
                            "higher is better)", [
                                row("latency, 16 float32 echo", "us", lat["jdist"],
                                    lat["torch"], ratios.get("lat"), "goal <= 1"),
                                row("CPU per call (both processes)", "us", cpu_call["jdist"],
                                    cpu_call["torch"], ratios.get("cpu_call")),
                                row("throughput, large array echo", "GB/s", tp["jdist"],
                                    tp["torch"], ratios.get("tp"), "goal >= 1"),
                                row("CPU per echo (both processes)", "ms", cpu_echo["jdist"],
                                    cpu_echo["torch"], ratios.get("cpu_echo"))]))
    if {"jdist", "raw"} <= lat.keys() and {"jdist", "raw"} <= tp.keys():
        tables.append(table("rpc_sync vs a raw Python socket", "raw socket",
                            "jdist / raw socket", [
                                row("latency, 16 float32 echo", "us", lat["jdist"], lat["raw"]),
                                row("throughput, large array echo", "GB/s", tp["jdist"],
                                    tp["raw"], ratios.get("tp_raw"), "goal >= 0.5"),
                                row("CPU per echo (both processes)", "ms", cpu_echo["jdist"],
                                    cpu_echo["raw"], ratios.get("cpu_raw"))]))
    if lat and tp:
        series["rpc"] = {"latency_us": lat, "throughput_GBps": tp}
    return Parsed(tables, series, "text" if tables else "none")


def parse_hybrid(output: str) -> Parsed:
    """benchmarks/hybrid.py: HybridModel (DDP + RPC) iteration time, jdist vs torch."""
    ms, ratio, note = {}, None, ""
    for ln in _lines(output):
        m = re.match(rf"\s+(jdist|torch)\s+({NUM}) ms / step", ln)
        if m:
            ms[m[1]] = num(m[2])
        m = re.search(rf"ratio jdist / torch:\s*({NUM})", ln)
        if m:
            ratio = num(m[1])
        m = re.search(rf"(max \|table_jdist - table_torch\|.*?:\s*{NUM})", ln)
        if m:
            note = m[1]
    if not {"jdist", "torch"} <= ms.keys():
        return Parsed([], {}, "none")
    return Parsed([table("HybridModel iteration (DDP trainers + RPC embedding server)",
                         "torch", "jdist / torch (lower is better)",
                         [row("ms per step", "ms", ms["jdist"], ms["torch"], ratio, note)])],
                  {}, "text")


TEXT_PARSERS: dict[str, Callable[[str], Parsed]] = {
    "ddp": parse_ddp, "dp": parse_dp, "hooks_optim": parse_hooks, "rpc": parse_rpc,
    "hybrid": parse_hybrid,
}


def parse(name: str, output: str) -> Parsed:
    """``BENCH_JSON`` lines if the output has any, else the text parser for ``name``."""
    got = from_json_lines(output)
    if got is not None:
        return got
    parser = TEXT_PARSERS.get(name)
    return parser(output) if parser else Parsed([], {}, "none")
