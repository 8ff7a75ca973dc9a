"""benchmarks/gpu.py, the GPU check script, without a GPU: its HLO schedule reader on the
form XLA:GPU prints, and one schedule case end to end on XLA:CPU (its ``--dry-run``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks.gpu import collective_schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the shape of XLA:GPU's scheduled text (jax 0.11.2, H200): an all-reduce is an
# async-start of a computation that wraps it, and an async-done naming the start
GPU_TEXT = """HloModule jit_body, is_scheduled=true

%region_1.2 (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.3 = f32[] add(%a, %b)
}

%async_computation.2 (param_0.1: f32[1049600]) -> f32[1049600] {
  %param_0.1 = f32[1049600]{0} parameter(0)
  ROOT %all-reduce.17 = f32[1049600]{0} all-reduce(%param_0.1), channel_id=1, to_apply=%region_1.2
}

ENTRY %main.28_spmd (p.0: f32[1024,1024], p.1: f32[64,1024]) -> f32[1049600] {
  %p.0 = f32[1024,1024]{1,0} parameter(0)
  %p.1 = f32[64,1024]{1,0} parameter(1)
  %fusion.1 = f32[64,1024]{1,0} fusion(%p.0, %p.1), kind=kCustom, calls=%g1
  %wrapped_concatenate.1 = f32[1049600]{0} fusion(%fusion.1), kind=kLoop, calls=%c1
  %all-reduce-start.2 = ((f32[1049600]{0}), f32[1049600]{0}) async-start(\
%wrapped_concatenate.1), calls=%async_computation.2
  %fusion.2 = f32[64,1024]{1,0} fusion(%fusion.1, %p.0), kind=kCustom, calls=%g2
  %fusion.3 = f32[1024,1024]{1,0} fusion(%fusion.2, %p.1), kind=kCustom, calls=%g3
  %all-reduce-done.2 = f32[1049600]{0} async-done(%all-reduce-start.2)
  %fusion.4 = f32[1049600]{0} fusion(%all-reduce-done.2, %fusion.3), kind=kLoop, calls=%c2
  ROOT %tuple.5 = (f32[1049600]{0}) tuple(%fusion.4)
}
"""


def test_reads_async_all_reduces_and_the_work_scheduled_inside_them():
    (ar,) = collective_schedule(GPU_TEXT)  # the wrapped all-reduce is not counted twice
    assert ar["async_"] is True
    assert ar["bytes"] == 1049600 * 4  # the done's shape, not the start's (in, out) tuple
    assert ar["overlapped"] == 2  # fusion.2 and fusion.3 run while it reduces
    assert ar["after"] == 1
    assert ar["total"] == 5


def test_reads_synchronous_all_reduces():
    text = GPU_TEXT.replace(
        "  %all-reduce-start.2 = ((f32[1049600]{0}), f32[1049600]{0}) async-start("
        "%wrapped_concatenate.1), calls=%async_computation.2\n", "").replace(
        "  %all-reduce-done.2 = f32[1049600]{0} async-done(%all-reduce-start.2)",
        "  %all-reduce-done.2 = f32[1049600]{0} all-reduce(%wrapped_concatenate.1), "
        "to_apply=%region_1.2")
    sched = [c for c in collective_schedule(text) if c["total"] == 5]
    assert [(c["async_"], c["overlapped"], c["after"]) for c in sched] == [(False, 0, 1)]


def test_schedule_case_runs_on_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), "--dry-run", "--part",
         "schedule", "--case", "1", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("PART_JSON ")][-1]
    (case,) = json.loads(line[len("PART_JSON "):])["cases"]
    # bucket_cap_mb=4 over 8 x Linear(1024, 1024): eight 4.2 MB buckets, one all-reduce
    # each, placed in backward order (each has less computation after it than the last)
    assert case["buckets"] == [4_198_400] * 8
    # the last bucket's all-reduce also carries the float32 loss for its mean (4 bytes)
    assert case["reduced_bytes"] == [4_198_400] * 7 + [4_198_404]
    assert case["after"] == sorted(case["after"], reverse=True)
