"""torch's ``DistributedDataParallel(...)`` arguments that jdist's constructor takes too.

A torch program keeps its ``DDP(model, device_ids=[rank], static_graph=True, ...)`` call
when ported. Each argument torch has and jdist does not name is, by :func:`translate`:

- accepted, because jdist already does what it asks: ``device_ids`` (at most one
  device) and ``output_device`` (the group's mesh places every array), ``dim=0``,
  ``check_reduction`` (ignored by torch too), ``static_graph`` (every step is one
  traced program), ``skip_all_reduce_unused_params`` (unused parameters' gradients are
  zeros either way), ``batched_grad_copy`` (a copy strategy of torch's reducer);
- translated: ``gradient_as_bucket_view=True`` is ``flat_buckets=False`` (gradients are
  not copied into a bucket buffer);
- refused with a ``ValueError`` that names the argument and what to do instead, when a
  value asks for something jdist does not do (``mixed_precision``, ``device_mesh``,
  ``delay_all_reduce_named_params``, ``param_to_hook_all_reduce``, ``dim != 0``,
  several ``device_ids``).

Names torch does not have still raise ``TypeError``, as Python does for any call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["TORCH_ONLY", "translate"]

# torch's name -> torch's default
TORCH_ONLY: dict[str, Any] = {
    "device_ids": None, "output_device": None, "dim": 0, "check_reduction": False,
    "gradient_as_bucket_view": False, "static_graph": False,
    "delay_all_reduce_named_params": None, "param_to_hook_all_reduce": None,
    "mixed_precision": None, "device_mesh": None, "skip_all_reduce_unused_params": False,
    "batched_grad_copy": False,
}
_FLAGS = ("check_reduction", "gradient_as_bucket_view", "static_graph",
          "skip_all_reduce_unused_params", "batched_grad_copy")
_REFUSED = {
    "mixed_precision": "set the Flax module's dtype/param_dtype (computation and "
                       "parameter dtypes), or reduce in a lower precision with "
                       "comm_hook=jdist.ddp.hooks.bf16_compress_hook",
    "device_mesh": "pass process_group= (a jdist ProcessGroup: a mesh axis already, "
                   "from jdist.new_group or the default group)",
    "delay_all_reduce_named_params": "drop it: jdist reduces every bucket inside the "
                                     "step's one compiled program, where XLA overlaps the "
                                     "reductions with the backward pass",
    "param_to_hook_all_reduce": "drop it: jdist reduces every bucket inside the step's "
                                "one compiled program, where XLA overlaps the reductions "
                                "with the backward pass",
}


def translate(torch_args: Mapping[str, Any], flat_buckets: bool | None) -> bool | None:
    """Check torch-only ``torch_args``; return ``flat_buckets`` as they set it."""
    unknown = sorted(set(torch_args) - set(TORCH_ONLY))
    if unknown:
        raise TypeError(
            f"DistributedDataParallel got unexpected keyword argument(s) {unknown}; it "
            f"takes jdist's own (process_group, bucket_cap_mb, find_unused_parameters, "
            f"broadcast_buffers, init_sync, comm_hook, compiler_options, flat_buckets, "
            f"forward_sync_buffers, bucket_cap_mb_list) and torch's {sorted(TORCH_ONLY)}")
    for name in _FLAGS:
        if name in torch_args and not isinstance(torch_args[name], bool):
            raise TypeError(f"DistributedDataParallel({name}={torch_args[name]!r}): "
                            f"expected True or False")
    for name, fix in _REFUSED.items():
        if torch_args.get(name) is not None:
            raise ValueError(f"DistributedDataParallel({name}={torch_args[name]!r}) is not "
                             f"supported by jdist: {fix}")
    if torch_args.get("dim", 0) != 0:
        raise ValueError(f"DistributedDataParallel(dim={torch_args['dim']!r}): jdist splits "
                         f"batches over the replicas along the leading axis; put the batch "
                         f"axis first and drop dim")
    ids = torch_args.get("device_ids")
    if ids is not None and (not isinstance(ids, list | tuple) or len(ids) > 1):
        raise ValueError(
            f"DistributedDataParallel(device_ids={ids!r}): give at most one device (torch's "
            f"device_ids=[local_rank]; jdist places arrays on the group's mesh anyway); "
            f"for several devices per process build the group over them "
            f"(jdist.init_process_group, new_group) and drop device_ids")
    if torch_args.get("gradient_as_bucket_view"):
        if flat_buckets:
            raise ValueError("DistributedDataParallel(gradient_as_bucket_view=True, "
                             "flat_buckets=True) disagree: gradient_as_bucket_view=True "
                             "means no copy into a flat bucket (flat_buckets=False); "
                             "give one of them")
        return False
    return flat_buckets
