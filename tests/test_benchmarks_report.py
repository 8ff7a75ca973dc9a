"""benchmarks/run_all.py's parsing and report writing, on canned benchmark outputs.

No benchmark runs here: the outputs below were captured from the real scripts (quick
sizes); the subprocess runner is checked with tiny ``python -c`` commands.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time

import pytest

from benchmarks import run_all
from benchmarks._parse import bench_json, parse, row, table
from benchmarks._report import Result, clean_output, fmt, fmt_ratio, machine_info, render

DDP_OUT = """\
(a)+(c) one process, 2 devices, MLP 784-1024x3-10, batch 128
  hand-written shard_map+pmean step    108.36 ms   compile 1.77 s
  jdist                                136.42 ms   compile 4.13 s   ratio 1.259x   compile ratio 2.34x
  jdist (XLA defaults)                 158.29 ms   compile 2.63 s   ratio 1.461x   compile ratio 1.49x
(b) 2 processes x 1 device, gloo, 1 thread each, global batch 128
  mlp: torch DDP    82.87 ms
       jdist                                169.86 ms   ratio 2.05x   (first step 5.29 s)
       jdist (no flat copy, XLA defaults)   170.55 ms   ratio 2.06x   (first step 3.88 s)
       compute only (1 process, 1 device, batch 64, no communication): torch    29.05 ms   JAX    47.89 ms   ratio 1.65x
  cnn: torch DDP    20.50 ms
       jdist                                 30.75 ms   ratio 1.50x   (first step 4.00 s)
"""  # noqa: E501

DP_OUT = """\
MLP 256-512-512-10, batch 1024, forward+backward (cpu, 2 cpus)
  one device (jit):                  212.20 ms
  DataParallel over 8 devices:       154.04 ms
  one jitted SPMD program, 8 devices (floor, no DataParallel): 129.53 ms
  ratio DataParallel / one device:     0.73x   (max |grad diff| 1.49e-08)
tiny MLP 16-32-4, batch 40 over 5 devices, forward+backward (dispatch cost)
  DataParallel (one SPMD program):                     63.30 ms
  scatter/replicate/parallel_apply/gather per device: 147.60 ms
  one device (jit):                                     0.09 ms
"""

HOOKS_OUT = """\
backend cpu, 8 devices

== bytes per replica per DDP step, MLP (64, 128, 128, 10) (26,122 params), 8 replicas ==
hook                     asked (lowered)   ratio  compiled (CPU)  collectives
no hook                          104,492     1.0         104,492            2
bf16_compress_hook                52,248     2.0         104,492            2
powerSGD_hook r=1                  3,412    30.6           3,412            5

== Adam step, MLP (64, 128, 128, 10), 8 replicas, batch 64, median of 5 ==
program                            step ms   opt-state bytes/replica
plain DP (all-reduce + Adam)          2.81                   208,984
ZeRO-1 (RS + shard Adam + AG)         1.21                    26,132
DDP train_step + Adam                 5.12                   208,984
ZeRO / plain: time x0.43, state memory x0.125 (ideal 1/8 = 0.125)
"""

RPC_OUT = """\
rpc_sync echo of 16 float32 (median of 200, best of 1 rounds); CPU = both processes:
  jdist  latency    308.1 us   CPU    325.0 us/call
  torch  latency  11891.4 us   CPU   5474.6 us/call
  raw    latency     36.5 us   CPU     43.8 us/call
echo of a 64 MiB float32 array (bytes moved / median round trip):
  jdist      0.20 GB/s   CPU    134.3 ms/echo
  torch      0.26 GB/s   CPU    168.0 ms/echo
  raw        0.28 GB/s   CPU    145.0 ms/echo
latency    jdist/torch = 0.03  (goal <= 1); CPU per call jdist/torch = 0.06
throughput jdist/torch = 0.76  (goal >= 1); CPU per echo jdist/torch = 0.80
throughput jdist/raw socket = 0.69  (goal >= 0.5); CPU per echo jdist/raw = 0.93
"""

HYBRID_OUT = """\
HybridModel: embedding 10000 x 64, batch 256, 10 steps (first 2 not timed), 3 processes, CPU
  jdist      35.10 ms / step (median over both trainers)
  torch      20.00 ms / step (median over both trainers)
  ratio jdist / torch: 1.75
  max |table_jdist - table_torch| after 10 steps: 2.98e-08
"""

ALLREDUCE = [{"bytes": 4096, "torch_ms": 0.28, "jdist_ms": 10.568, "jdist_nocheck_ms": 4.661},
             {"bytes": 1 << 20, "torch_ms": 3.786, "jdist_ms": 3.848, "jdist_nocheck_ms": 3.295}]
COLLECTIVES_OUT = "   4 KiB |     0.280 |    10.568 |  37.81\n" + bench_json(
    "collectives", [table("all_reduce", "torch (gloo)", "jdist / torch",
                          [row("4 KiB", "ms", 10.568, 0.28, 37.81),
                           row("1 MiB", "ms", 3.848, 3.786, 1.02)])],
    {"allreduce": ALLREDUCE}) + "\n"


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, waiting for its reaper, counts as gone)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        if state == "Z":
            return False
        time.sleep(0.05)
    return True


def rows_of(p):
    return {r["case"]: r for t in p.tables for r in t["rows"]}


def test_text_parsers_read_the_printed_numbers():
    ddp = parse("ddp", DDP_OUT)
    assert ddp.source == "text"
    r = rows_of(ddp)
    assert (r["jdist"]["jdist"], r["jdist"]["baseline"], r["jdist"]["ratio"]) == \
        (136.42, 108.36, 1.259)
    assert (r["mlp: jdist"]["jdist"], r["mlp: jdist"]["baseline"], r["mlp: jdist"]["ratio"]) \
        == (169.86, 82.87, 2.05)
    assert r["mlp: plain JAX step"]["ratio"] == 1.65
    assert ddp.series["ddp"] == {
        "mlp": {"torch DDP": 82.87, "jdist": 169.86, "jdist (no flat copy, XLA defaults)": 170.55},
        "cnn": {"torch DDP": 20.5, "jdist": 30.75}}
    compile_rows = next(t for t in ddp.tables if t["title"].startswith("(c)"))["rows"]
    assert [x["ratio"] for x in compile_rows] == [2.34, 1.49]

    r = rows_of(parse("dp", DP_OUT))
    main = r["DataParallel vs one device (jit)"]
    assert (main["jdist"], main["baseline"], main["ratio"]) == (154.04, 212.2, 0.73)
    floor = r["DataParallel vs one jitted SPMD program (floor)"]
    assert floor["ratio"] == pytest.approx(154.04 / 129.53) and "computed" in floor["note"]
    assert r["tiny MLP: scatter/replicate/parallel_apply/gather per device"]["baseline"] == 0.09

    r = rows_of(parse("hooks_optim", HOOKS_OUT))
    assert (r["powerSGD_hook r=1"]["jdist"], r["powerSGD_hook r=1"]["baseline"],
            r["powerSGD_hook r=1"]["ratio"]) == (3412, 104492, 30.6)
    assert "104,492 bytes" in r["bf16_compress_hook"]["note"]
    z = r["optimizer state per replica: ZeRO-1 (RS + shard Adam + AG)"]
    assert (z["jdist"], z["baseline"], z["ratio"]) == (26132, 208984, 0.125)
    assert r["step time: ZeRO-1 (RS + shard Adam + AG)"]["ratio"] == 0.43

    rpc = parse("rpc", RPC_OUT)
    assert rpc.series["rpc"] == {"latency_us": {"jdist": 308.1, "torch": 11891.4, "raw": 36.5},
                                 "throughput_GBps": {"jdist": 0.2, "torch": 0.26, "raw": 0.28}}
    vs_torch, vs_raw = ({r["case"]: r for r in t["rows"]} for t in rpc.tables)
    assert vs_torch["latency, 16 float32 echo"]["ratio"] == 0.03
    assert vs_torch["throughput, large array echo"]["ratio"] == 0.76
    assert vs_raw["throughput, large array echo"]["ratio"] == 0.69
    assert vs_raw["latency, 16 float32 echo"]["ratio"] == pytest.approx(308.1 / 36.5)

    (h,) = rows_of(parse("hybrid", HYBRID_OUT)).values()
    assert (h["jdist"], h["baseline"], h["ratio"]) == (35.1, 20.0, 1.75)
    assert "2.98e-08" in h["note"]


def test_unrecognised_output_gives_no_tables():
    for name in ("ddp", "dp", "hooks_optim", "rpc", "hybrid", "store"):
        p = parse(name, "Traceback (most recent call last):\nRuntimeError: boom\n")
        assert p.tables == [] and p.source == "none"


def test_bench_json_wins_and_round_trips():
    p = parse("collectives", COLLECTIVES_OUT)
    assert p.source == "BENCH_JSON" and p.series["allreduce"] == ALLREDUCE
    assert rows_of(p)["4 KiB"]["ratio"] == 37.81
    # a BENCH_JSON line overrides the text parser of a benchmark that has one
    p = parse("hybrid", HYBRID_OUT + bench_json("hybrid", [table("t", "torch", "j/t",
                                                                 [row("x", "ms", 1.0, 2.0)])]))
    assert p.source == "BENCH_JSON" and rows_of(p)["x"]["ratio"] == 0.5
    nan = json.loads(bench_json("x", [], {"v": math.nan})[len("BENCH_JSON "):])
    assert math.isnan(nan["series"]["v"])
    with pytest.raises(ValueError, match="bad BENCH_JSON line"):
        parse("store", "BENCH_JSON {not json\n")


def test_quick_args_prefer_the_scripts_own_flag():
    b = run_all.Bench("x", "X", "x.py", quick=("--steps", "5"))
    assert run_all.quick_args(b, 'p.add_argument("--quick", "--smoke")') == ["--quick"]
    assert run_all.quick_args(b, "p.add_argument('--smoke')") == ["--smoke"]
    assert run_all.quick_args(b, 'p.add_argument("--steps")') == ["--steps", "5"]
    assert {b.name for b in run_all.BENCHES} >= {
        "store", "collectives", "ring_allreduce", "sampler", "ddp", "hooks_optim", "dp",
        "rpc", "hybrid"}


def test_runner_missing_failed_timed_out_and_ok(tmp_path):
    missing = run_all.run_bench(run_all.Bench("hybrid", "Hybrid", "benchmarks/nope.py"),
                                True, root=tmp_path)
    assert missing.status == "missing" and "nope.py" in missing.detail

    # on timeout the benchmark and a worker in a session of its own (as spawn starts
    # them) are both stopped
    code = ("import subprocess, sys, time\n"
            "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
            " start_new_session=True)\n"
            "print('partial', w.pid, flush=True)\ntime.sleep(60)\n")
    out, rc, secs = run_all.run_command([sys.executable, "-c", code], timeout=1.5)
    assert rc is None and secs < 15 and "partial" in out
    worker = int(out.split()[1])
    assert not alive(worker), f"worker {worker} outlived the timeout"
    out, rc, _ = run_all.run_command(
        [sys.executable, "-c", "import sys; print('bad'); sys.exit(3)"], timeout=30)
    assert (rc, out.strip()) == (3, "bad")

    script = tmp_path / "fake.py"
    script.write_text(f"import sys\nprint({COLLECTIVES_OUT!r})\nprint(sys.argv[1:])\n")
    ok = run_all.run_bench(run_all.Bench("collectives", "C", "fake.py", quick=("--n", "2")),
                           True, root=tmp_path)
    assert ok.status == "ok" and ok.command == "python fake.py --n 2"
    assert "['--n', '2']" in ok.output and ok.parsed.series["allreduce"] == ALLREDUCE
    skipped = run_all.run_bench(run_all.Bench("collectives", "C", "fake.py"), True,
                                root=tmp_path, budget=run_all.MIN_SECONDS - 1)
    assert skipped.status == "skipped" and "budget" in skipped.detail and not skipped.output


def test_report_tables_plots_machine_and_raw_output(tmp_path):
    results = [
        Result("collectives", "Eager all_reduce", "python benchmarks/collectives.py --quick",
               "ok", "", 23.0, COLLECTIVES_OUT, parse("collectives", COLLECTIVES_OUT)),
        Result("ddp", "DDP", "python benchmarks/ddp.py --steps 5", "ok", "", 300.0, DDP_OUT,
               parse("ddp", DDP_OUT)),
        Result("rpc", "RPC", "python benchmarks/rpc.py --smoke", "timed out",
               "killed after 240 s", 240.0, RPC_OUT + "```\n\x1b[31mred\x1b[0m",
               parse("rpc", RPC_OUT)),
        Result("hybrid", "HybridModel", "python benchmarks/hybrid.py", "ok", "", 50.0,
               HYBRID_OUT, parse("hybrid", HYBRID_OUT)),
        Result("hybrid", "HybridModel", "python benchmarks/hybrid.py", "missing",
               "benchmarks/hybrid.py does not exist", 0.0, "", parse("hybrid", "")),
        Result("dp", "DataParallel", "python benchmarks/dp.py", "skipped",
               "only 3 s of the time budget left", 0.0, "", parse("dp", "")),
    ]
    machine = machine_info(str(tmp_path))
    machine["load_end"] = "1.00, 1.00, 1.00"
    out = run_all.write_report(results, machine, tmp_path / "docs" / "bench.md", mode="quick",
                               started="2026-01-01 00:00 UTC", total_s=563.0,
                               command="python benchmarks/run_all.py --quick")
    md = out.read_text()
    for name in ("allreduce.png", "ddp_step.png", "rpc.png"):
        png = tmp_path / "docs" / "img" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"](img/{name})" in md
    for target in re.findall(r"\]\(([^)#\s]+)\)", md):  # every relative link resolves
        assert (out.parent / target).exists(), target
    assert machine["cpu"] in md and "| memory |" in md and "1.00, 1.00, 1.00" in md
    assert "jax " + machine["versions"]["jax"] in md
    assert "quick mode" in md and "9.4 min" in md
    assert "| mlp: jdist | ms | 169.86 | 82.87 | 2.05 |" in md
    assert "| 4 KiB | ms | 10.568 | 0.28 | 37.8 |" in md
    assert "| case | unit | plain JAX | torch | ratio | note |" in md  # ddp attribution
    # the summary quotes a row with a goal where there is one
    assert "| RPC | **timed out** | 240 s | latency, 16 float32 echo: 308.1 vs 11,891.4 us " \
           "(torch), ratio 0.03 |" in md
    assert "| latency, 16 float32 echo | us | 308.1 | 11,891.4 | 0.03 | goal <= 1 |" in md
    assert "**timed out**" in md and "killed after 240 s" in md
    assert "**missing**" in md and "benchmarks/hybrid.py does not exist" in md
    # a pipe in a note is escaped: the row keeps its 6 cells
    assert "| 1.75 | max \\|table_jdist - table_torch\\| after 10 steps: 2.98e-08 |" in md
    assert "**skipped**" in md and "only 3 s of the time budget left" in md
    # raw output for the ones that ran, not for the missing or skipped ones
    assert md.count("<details><summary>raw output</summary>") == 4
    assert "\x1b" not in md and "\n'''" in md  # ANSI stripped, fences in output defused
    assert render(results[:1], machine, {}, mode="full", started="s", total_s=1.0,
                  command="c").count("Quick mode") == 0
    # a later run without RPC numbers drops the old RPC plot instead of leaving it stale
    run_all.write_report(results[:2], machine, out, mode="quick", started="s", total_s=1.0,
                         command="c")
    assert not (tmp_path / "docs" / "img" / "rpc.png").exists()
    assert (tmp_path / "docs" / "img" / "ddp_step.png").exists()


def test_formatting_helpers():
    assert [fmt(x) for x in (104492.0, 3412, 11891.4, 169.86, 20.5, 1.259, 0.000123, None)] \
        == ["104,492", "3,412", "11,891.4", "169.86", "20.5", "1.259", "0.000123", "-"]
    assert fmt(2.3648249998586834) == "2.3648" and fmt_ratio(0.125) == "0.125"
    text = "a\rprogress 10%\rprogress 100%\n" + "\n".join(map(str, range(1000)))
    cleaned = clean_output(text, max_lines=10)
    assert cleaned.splitlines()[0] == "progress 100%" and "lines left out" in cleaned
