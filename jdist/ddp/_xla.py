"""XLA options that keep DDP's buckets as the unit of communication.

jdist builds one all-reduce per bucket inside the backward pass. XLA has passes of its
own that re-bucket collectives, so DDP compiles its step with options derived from
``bucket_cap_mb``:

- **CPU**: the ``cpu-all-reduce-combiner`` pass merges *every* all-reduce of the program
  into one, placed after the last backward computation (no overlap, one giant bucket).
  DDP disables it for its programs (``xla_disable_hlo_passes``), so each bucket's
  all-reduce stays separate and is scheduled as soon as its gradients exist.
- **GPU**: the all-reduce combiner merges collectives up to
  ``xla_gpu_all_reduce_combine_threshold_bytes``; DDP sets it to the bucket cap, so XLA
  does not merge buckets beyond the size the user asked for, and keeps the latency hiding
  scheduler on (``xla_gpu_enable_latency_hiding_scheduler``), which overlaps the
  asynchronous all-reduces with the remaining backward computation.

Pass ``compiler_options={}`` to ``DistributedDataParallel`` to compile with XLA's own
defaults (or a dict of your own options to use those instead).
"""

from __future__ import annotations

from jdist.ddp._buckets import bucket_cap_bytes

__all__ = ["bucket_compiler_options"]


def bucket_compiler_options(bucket_cap_mb: float | None, platform: str) -> dict:
    """The compiler options DDP uses on ``platform`` for a ``bucket_cap_mb`` setting."""
    _, cap = bucket_cap_bytes(bucket_cap_mb)
    if platform == "cpu":
        return {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}
    if platform in ("gpu", "cuda", "rocm"):
        return {
            "xla_gpu_all_reduce_combine_threshold_bytes": int(cap),
            "xla_gpu_enable_latency_hiding_scheduler": True,
        }
    return {}
