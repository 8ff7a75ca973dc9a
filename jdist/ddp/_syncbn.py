"""``convert_sync_batchnorm``: BatchNorm statistics over all replicas (torch's SyncBatchNorm).

NNX's ``BatchNorm`` already knows how to reduce its batch statistics over a mesh axis
(``axis_name``): the mean and the mean of squares are averaged with ``lax.pmean``. Inside
DDP's ``shard_map`` every replica holds an equal share of the global batch, so the
result equals BatchNorm over the global batch (torch all-gathers per-rank counts to allow
unequal shares; DDP's even split makes plain averaging exact). In eval mode
(``use_running_average=True``) nothing is communicated, as in torch.
"""

from __future__ import annotations

from flax import nnx

from jdist.collectives._group import ProcessGroup, resolve_group

__all__ = ["convert_sync_batchnorm"]


def convert_sync_batchnorm(module: nnx.Module, process_group: ProcessGroup | None = None
                           ) -> nnx.Module:
    """Make every ``nnx.BatchNorm`` in ``module`` synchronize over the group's replicas.

    Unlike torch, which builds new ``SyncBatchNorm`` modules sharing the parameters, the
    NNX layers are switched in place (their ``axis_name`` is set to the group's axis)
    and ``module`` itself is returned. Use the module under DDP (or inside your own
    ``shard_map`` over that axis); called outside one, a synchronized BatchNorm raises
    JAX's unbound-axis error.

    Args:
      module: an NNX module (or a BatchNorm itself).
      process_group: the group whose replicas share statistics (default group).

    Returns:
      ``module``, converted.
    """
    if not isinstance(module, nnx.Module):
        raise TypeError(
            f"convert_sync_batchnorm expects a flax.nnx.Module, got {type(module).__name__}; "
            "for Linen pass axis_name=... to nn.BatchNorm yourself")
    axis = resolve_group(process_group).axis_name
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.BatchNorm):
            node.axis_name = axis
    return module
