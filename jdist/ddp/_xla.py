"""XLA options that keep DDP's buckets as the unit of communication.

jdist reduces each bucket with one all-reduce inside the backward pass. How that single
all-reduce comes about depends on whether the bucket is copied into a flat buffer:

- **No copy** (no comm hook; the default on one process and on GPU): the bucket's gradients
  are reduced by one ``pmean`` of all of them, which XLA lowers to one all-reduce per
  gradient (an SPMD program cannot all-reduce several arrays in one op: XLA's
  partitioner rejects a variadic all-reduce in manual mode). XLA's all-reduce combiner
  then merges them into one variadic all-reduce per bucket, with no copy: it merges
  all-reduces that do not depend on each other, and the reducer makes every bucket's
  gradients depend (at the cost of a one-element update) on the previous bucket's
  reduced values, so buckets are never merged with each other. The combiner stays on.
- **Flat buffers** (a comm hook is registered, or ``flat_buckets=True``; the default
  across processes on CPU, where gloo runs a variadic all-reduce as one collective per
  array): each bucket is one flat array and the hook's collectives run on it. On CPU the
  ``cpu-all-reduce-combiner`` pass, which merges *every* independent all-reduce of a
  program into one placed after the last backward computation, is disabled
  (``xla_disable_hlo_passes``), so each bucket's all-reduce stays separate and is
  scheduled as soon as its gradients exist.
- **GPU**: the all-reduce combiner merges collectives up to
  ``xla_gpu_all_reduce_combine_threshold_bytes``; DDP sets it to the bucket cap, or to
  the largest bucket where one is larger (torch closes a bucket once it *reaches* the cap,
  so a bucket can exceed it: 7 x 4.2 MB under the 25 MiB cap is one 29.4 MB bucket; with
  the cap as threshold XLA:GPU split it into two all-reduces, 24 and 4 MiB, seen in the
  compiled program of ``benchmarks/gpu.py``), so XLA merges each bucket into one
  all-reduce and never beyond; buckets are not merged with each other (see above). It
  keeps the latency hiding scheduler on (``xla_gpu_enable_latency_hiding_scheduler``),
  which overlaps the asynchronous all-reduces with the remaining backward computation.

Pass ``compiler_options={}`` to ``DistributedDataParallel`` to compile with XLA's own
defaults (or a dict of your own options to use those instead).
"""

from __future__ import annotations

from jdist.ddp._buckets import bucket_cap_bytes

__all__ = ["bucket_compiler_options"]


def bucket_compiler_options(bucket_cap_mb: float | None, platform: str, *,
                            combine: bool = False, largest_bucket: int = 0) -> dict:
    """The compiler options DDP uses on ``platform`` for a ``bucket_cap_mb`` setting.

    Args:
      bucket_cap_mb: the DDP bucket cap (``None``: 25 MiB).
      platform: ``"cpu"``, ``"gpu"``/``"cuda"``/``"rocm"`` or another backend name.
      combine: whether the program relies on XLA's all-reduce combiner to make one
        all-reduce per bucket (the default reduction, without flat buffers); ``False``
        for programs with flat bucket buffers.
      largest_bucket: bytes of the largest bucket of the layout (GPU: the combiner's
        threshold is at least this, so no bucket is split).
    """
    _, cap = bucket_cap_bytes(bucket_cap_mb)
    if platform == "cpu":
        return {} if combine else {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}
    if platform in ("gpu", "cuda", "rocm"):
        return {
            "xla_gpu_all_reduce_combine_threshold_bytes": int(max(cap, largest_bucket)),
            "xla_gpu_enable_latency_hiding_scheduler": True,
        }
    return {}
