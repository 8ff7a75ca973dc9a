"""Horovod's ``broadcast_parameters`` / ``broadcast_optimizer_state``, ready for a step.

Horovod's sequence is: every rank builds its model and optimizer (with different random
initial values), rank 0's values are broadcast, then every rank trains. Here the
broadcast is one eager collective for the whole tree (``broadcast_coalesced``: every
leaf's bytes in one buffer, bit for bit), and the result is *placed*: each array leaf
becomes a global array replicated over the group's mesh (``NamedSharding(group.mesh,
P())``), which is what a ``jax.shard_map`` step over that mesh with ``in_specs=P()``
for parameters and optimizer state takes as it is, across processes::

    params = jdist.optim.broadcast_parameters(params, root_rank=0)
    opt_state = jdist.optim.broadcast_optimizer_state(dtx.init(params), root_rank=0)
    step = jax.jit(jax.shard_map(body, mesh=group.mesh, in_specs=(P(), P(), P("dp")),
                                 out_specs=(P(), P()), check_vma=False))

(``check_vma=False``: with it on, ``jax.grad`` of the replicated parameters would
already sum the gradients over the replicas; ``AllReduceOptimizer`` refuses those.)

Flax NNX modules and ``nnx.Optimizer`` are updated in place (every Variable: params,
batch statistics, RNG keys, optimizer moments and step) and returned. Without
``init_process_group`` there is nothing to broadcast: the values are only placed on the
embedded group's mesh.
"""

from __future__ import annotations

from typing import Any

from jdist.collectives import (
    ProcessGroup,
    broadcast_coalesced,
    is_initialized,
    place_replicated,
)

__all__ = ["broadcast_optimizer_state", "broadcast_parameters"]


def _is_graph_node(x) -> bool:
    from flax import nnx

    return nnx.graph.is_graph_node(x)


def _broadcast_placed(tree: Any, root_rank: int, group: ProcessGroup | None, what: str):
    if group is not None or is_initialized():
        tree = broadcast_coalesced(tree, src=root_rank, group=group)
    elif root_rank != 0:
        raise ValueError(f"jdist.optim.{what}: root_rank={root_rank!r} but there is one "
                         f"process (no init_process_group); use root_rank=0 or initialise "
                         f"the process group first")
    return place_replicated(tree, group)


def _broadcast(obj: Any, root_rank: int, group, what: str):
    if _is_graph_node(obj):
        from flax import nnx

        nnx.update(obj, _broadcast_placed(nnx.state(obj), root_rank, group, what))
        return obj
    return _broadcast_placed(obj, root_rank, group, what)


def broadcast_parameters(params_or_module: Any, root_rank: int = 0,
                         group: ProcessGroup | None = None) -> Any:
    """Every rank gets ``root_rank``'s parameters, replicated on the group's mesh.

    Horovod's ``hvd.broadcast_parameters(model.state_dict(), root_rank=0)``.

    Args:
      params_or_module: a pytree of arrays (and numbers), or a Flax NNX module (every
        Variable is broadcast: parameters, batch statistics, RNG state).
      root_rank: the global rank whose values win.
      group: a ``ProcessGroup``, or None (the default group).

    Returns:
      A pytree: the same structure, array leaves as global arrays replicated over
      ``group.mesh``. A module: the module itself, updated in place.

    Raises:
      ValueError: a rank's tree differs from the root's (structure, shapes, dtypes).
      TypeError: a leaf is neither an array nor a number (names the leaf).
    """
    return _broadcast(params_or_module, root_rank, group, "broadcast_parameters")


def broadcast_optimizer_state(state: Any, root_rank: int = 0,
                              group: ProcessGroup | None = None) -> Any:
    """Every rank gets ``root_rank``'s optimizer state, replicated on the group's mesh.

    Horovod's ``hvd.broadcast_optimizer_state(optimizer, root_rank=0)``: ``state`` is an
    optax state (e.g. ``AllReduceOptimizer(tx).init(params)``) or an ``nnx.Optimizer``
    (updated in place: moments and step). Same rules as :func:`broadcast_parameters`.
    """
    return _broadcast(state, root_rank, group, "broadcast_optimizer_state")
