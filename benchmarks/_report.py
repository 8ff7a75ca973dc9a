"""The benchmark report: machine description, Markdown tables, PNG plots.

:func:`render` is pure (results in, Markdown out); :func:`machine_info` reads /proc and
package metadata; :func:`make_plots` writes PNGs with matplotlib's Agg backend.
"""

from __future__ import annotations

import math
import os
import platform
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

from benchmarks._parse import Parsed

MAX_RAW_LINES = 400
PACKAGES = ("jax", "jaxlib", "flax", "optax", "torch", "numpy")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Result(NamedTuple):
    """One benchmark's run.

    Attributes:
        name: short name (``store``, ``ddp``, ...).
        title: what it measures, for the heading.
        command: the command line as run (shown in the report).
        status: ``ok``, ``failed``, ``timed out``, ``skipped`` or ``missing``.
        detail: why it is not ``ok`` (exit status, timeout, missing file); ``""`` if ok.
        seconds: wall time of the run.
        output: its stdout and stderr, interleaved.
        parsed: what was read from ``output``.
    """

    name: str
    title: str
    command: str
    status: str
    detail: str
    seconds: float
    output: str
    parsed: Parsed


# --------------------------------------------------------------------------- machine
def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    m = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    return m[1].strip() if m else (platform.processor() or "unknown")


def _mem_gib() -> float | None:
    try:
        m = re.search(r"^MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    except OSError:
        return None
    return int(m[1]) / (1 << 20) if m else None


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "not installed"


def _git_commit(root: str) -> str:
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def machine_info(root: str) -> dict:
    """CPU, cores, memory, load, OS, Python and library versions, git commit."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    mem = _mem_gib()
    return {
        "cpu": _cpu_model(),
        "cores": f"{os.cpu_count()} logical" + (f", {usable} usable" if usable else ""),
        "memory": f"{mem:.1f} GiB" if mem else "unknown",
        "load_start": load_average(),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "versions": {p: _version(p) for p in PACKAGES},
        "commit": _git_commit(root),
    }


def load_average() -> str:
    """``os.getloadavg()`` as ``"1.00, 0.50, 0.25"`` (1, 5, 15 minutes)."""
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


# --------------------------------------------------------------------------- numbers
def fmt(x) -> str:
    """A number for a table: 5 significant digits (what the benchmarks print), large
    numbers with thousands separators."""
    if x is None:
        return "-"
    x = float(x)
    if math.isnan(x) or math.isinf(x):
        return str(x)
    if x.is_integer() and abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 1e4:
        return f"{x:,.1f}"
    return f"{x:.5g}"


def fmt_ratio(x) -> str:
    """A ratio: 3 significant digits."""
    if x is None or math.isnan(float(x)):
        return "-"
    return f"{float(x):.3g}"


def clean_output(text: str, max_lines: int = MAX_RAW_LINES) -> str:
    """Raw output for a fenced block: no ANSI codes, ``\\r`` redraws collapsed, no fences."""
    lines = []
    for ln in ANSI.sub("", text).split("\n"):
        ln = ln.rsplit("\r", 1)[-1] if "\r" in ln.rstrip("\r") else ln.rstrip("\r")
        lines.append("'''" + ln[3:] if ln.startswith("```") else ln)
    if len(lines) > max_lines:
        half = max_lines // 2
        cut = len(lines) - 2 * half
        lines = lines[:half] + [f"... ({cut} lines left out) ..."] + lines[-half:]
    return "\n".join(lines)


# --------------------------------------------------------------------------- markdown
def cell(text) -> str:
    """Text for a Markdown table cell: pipes escaped, on one line."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table_md(t: dict) -> list[str]:
    out = [f"**{t['title']}**. Ratio: {t['ratio']}.", "",
           f"| case | unit | {cell(t.get('subject', 'jdist'))} | {cell(t['baseline'])} "
           f"| ratio | note |",
           "|---|---|--:|--:|--:|---|"]
    for r in t["rows"]:
        out.append(f"| {cell(r['case'])} | {cell(r['unit'])} | {fmt(r['jdist'])} "
                   f"| {fmt(r['baseline'])} | {fmt_ratio(r['ratio'])} "
                   f"| {cell(r.get('note', ''))} |")
    return out + [""]


def headline(res: Result) -> str:
    """One row in a few words: the first with a goal, else the first whose two numbers
    differ, else the first."""
    rows = [(t, r) for t in res.parsed.tables for r in t["rows"]]
    pick = (next(((t, r) for t, r in rows if "goal" in r.get("note", "")), None)
            or next(((t, r) for t, r in rows if r["jdist"] != r["baseline"]), None)
            or (rows[0] if rows else None))
    if pick is None:
        return "no numbers parsed" if res.status == "ok" else res.detail
    t, r = pick
    return (f"{r['case']}: {fmt(r['jdist'])} vs {fmt(r['baseline'])} {r['unit']} "
            f"({t['baseline']}), ratio {fmt_ratio(r['ratio'])}")


def render(results: list[Result], machine: dict, images: dict, *, mode: str,
           started: str, total_s: float, command: str,
           gpu_link: str = "gpu.md") -> str:
    """The whole report as Markdown.

    Args:
        results: one per benchmark, in run order.
        machine: from :func:`machine_info`, plus ``load_end``.
        images: ``{benchmark name: [(caption, path relative to the report)]}``.
        mode: ``"quick"`` or ``"full"``.
        started: when the run began (UTC, printable).
        total_s: wall time of the whole run.
        command: the command line that produced the report.
        gpu_link: the path of docs/gpu.md relative to the report.
    """
    v = machine["versions"]
    out = [
        "# Benchmarks", "",
        f"Generated by `{command}` ({mode} mode) on {started}, commit {machine['commit']}; "
        f"{len(results)} benchmarks in {total_s / 60:.1f} min.", "",
        "Every number is one that the benchmark printed: read from its `BENCH_JSON` line or, "
        "for benchmarks without one, parsed from its printed table (ratios the benchmark did "
        "not print are computed from its two numbers and marked so). Each benchmark runs "
        "jdist and its baseline in the same run. Its raw output is under its tables.", "",
        "This machine has no GPU. Results from a GPU machine (`benchmarks/gpu.py`) are in "
        f"[gpu.md]({gpu_link}).", "",
    ]
    if mode == "quick":
        out += ["Quick mode uses fewer sizes, steps and repetitions than the benchmarks' "
                "defaults: the numbers are noisier. Run `python benchmarks/run_all.py` for the "
                "full set.", ""]
    out += [
        "## Machine", "",
        "| | |", "|---|---|",
        f"| CPU | {machine['cpu']} |",
        f"| cores | {machine['cores']} |",
        f"| memory | {machine['memory']} |",
        f"| load average (1, 5, 15 min) | at start {machine['load_start']}; "
        f"at end {machine.get('load_end', 'unknown')} |",
        f"| OS | {machine['os']} |",
        f"| Python | {machine['python']} |",
        "| libraries | " + ", ".join(f"{k} {val}" for k, val in v.items()) + " |", "",
        "## Summary", "",
        "| benchmark | status | wall time | first result |", "|---|---|--:|---|",
    ]
    for r in results:
        status = r.status if r.status == "ok" else f"**{r.status}**"
        out.append(f"| {cell(r.title)} | {status} | {r.seconds:.0f} s | {cell(headline(r))} |")
    out.append("")
    for r in results:
        out += [f"## {r.title}", "", f"`{r.command}`: {r.status}"
                + (f" ({r.detail})" if r.detail else "") + f", {r.seconds:.0f} s.", ""]
        if r.status in ("missing", "skipped"):
            continue
        if not r.parsed.tables:
            out += ["No result table could be read from its output (see the raw output).", ""]
        for t in r.parsed.tables:
            out += _table_md(t)
        for caption, path in images.get(r.name, []):
            out += [f"![{caption}]({path})", ""]
        out += ["<details><summary>raw output</summary>", "", "```text",
                clean_output(r.output), "```", "", "</details>", ""]
    return "\n".join(out)


# --------------------------------------------------------------------------- plots
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_allreduce(points: list, path: Path) -> None:
    """all_reduce time vs size, jdist (with and without its check) and torch, log-log."""
    plt = _plt()
    pts = sorted(points, key=lambda p: p["bytes"])
    x = [p["bytes"] for p in pts]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for key, label, style in (("torch_ms", "torch (gloo)", "o-"),
                              ("jdist_ms", "jdist", "s-"),
                              ("jdist_nocheck_ms", "jdist, JDIST_DEBUG=OFF", "^--")):
        ys = [p.get(key) for p in pts]
        if all(y is not None for y in ys):
            ax.plot(x, ys, style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB" for b in x])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("float32 bytes per process")
    ax.set_ylabel("median time per all_reduce (ms)")
    ax.set_title("Eager all_reduce, 2 processes")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_ddp(models: dict, path: Path) -> None:
    """DDP step time per model: torch DDP and each jdist variant, grouped bars."""
    plt = _plt()
    labels = list(dict.fromkeys(k for m in models.values() for k in m))
    names = list(models)
    width = 0.8 / max(len(labels), 1)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, label in enumerate(labels):
        xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(names))]
        ys = [models[n].get(label, float("nan")) for n in names]
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(names)), [n.upper() for n in names])
    ax.set_ylabel("median ms per training step")
    ax.set_title("DDP step, 2 processes (gloo)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_rpc(data: dict, path: Path) -> None:
    """RPC latency and throughput: jdist, torch RPC and a raw socket side by side."""
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.8))
    for ax, key, ylabel, title in ((a, "latency_us", "median us per call", "latency (small)"),
                                   (b, "throughput_GBps", "GB/s", "throughput (large)")):
        d = data.get(key, {})
        names = [n for n in ("jdist", "torch", "raw") if n in d]
        bars = ax.bar(names, [d[n] for n in names], color=["C0", "C1", "C2"][:len(names)])
        ax.bar_label(bars, fmt="%.2f" if key.startswith("through") else "%.0f", fontsize=8)
        vals = [d[n] for n in names if d[n] > 0]
        if vals and max(vals) / min(vals) > 20:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
    fig.suptitle("rpc_sync echo, 2 processes: jdist vs torch RPC vs raw socket")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


PLOTS = (  # series key, image file, caption, plot function
    ("allreduce", "allreduce.png", "all_reduce time vs size, jdist and torch", plot_allreduce),
    ("ddp", "ddp_step.png", "DDP step time per model, jdist and torch", plot_ddp),
    ("rpc", "rpc.png", "RPC latency and throughput, jdist, torch and a raw socket", plot_rpc),
)


def make_plots(results: list[Result], img_dir: Path, rel: str) -> dict:
    """Writes a PNG for each series some benchmark produced; removes the PNG of a
    series that none produced this time (left from an earlier run, it would not match
    the report).

    Returns:
        ``{benchmark name: [(caption, rel + "/" + file)]}`` for :func:`render`.
    """
    images: dict = {}
    written = set()
    for r in results:
        for key, fname, caption, fn in PLOTS:
            data = r.parsed.series.get(key)
            if not data:
                continue
            img_dir.mkdir(parents=True, exist_ok=True)
            fn(data, img_dir / fname)
            written.add(fname)
            images.setdefault(r.name, []).append((caption, f"{rel}/{fname}"))
    for _, fname, _, _ in PLOTS:
        if fname not in written:
            (img_dir / fname).unlink(missing_ok=True)
    return images
