"""In-graph collectives with torch's names, for use inside ``jit`` / ``shard_map``.

``torch.distributed`` code runs one collective call per process on its own tensor;
in JAX the same program runs on every replica of a mesh axis inside ``jax.shard_map``.
These functions give that program torch's collective names and semantics::

    import jax
    from jax.sharding import PartitionSpec as P
    from jdist.collectives import functional as F

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=P("dp"), out_specs=P())
    def mean_grads(g):
        return F.all_reduce(g, F.ReduceOp.AVG, "dp")

``group`` may be an axis name, a tuple of axis names (one collective over their
product, e.g. ``("a", "b")`` on a 2-D mesh), a :class:`~jdist.ProcessGroup` (its
``axis_name``) or ``None`` (the default group's axis; ``"dp"`` without
``init_process_group``). ``src``/``dst`` are replica indices along that axis
(``lax.axis_index``), not process ranks. Every function works on pytrees.

=====================================  =============================================
torch.distributed                      jdist.collectives.functional
=====================================  =============================================
``all_reduce(t, op)``                  ``all_reduce(x, op, group)``
``all_reduce_coalesced(ts, op)``       ``all_reduce_flat(tree, op, group)`` (per dtype)
``broadcast(t, src)``                  ``broadcast(x, src, group)``
``reduce(t, dst, op)``                 ``reduce(x, dst, op, group)`` (others keep x)
``all_gather(list, t)``                ``all_gather(x, group, axis=0)`` (stacked)
``all_gather_into_tensor(out, t)``     ``all_gather_into_tensor(x, group)`` (tiled)
``gather(t, list, dst)``               ``gather(x, dst, group)`` (all replicas get it)
``scatter(t, list, src)``              ``scatter(x, src, group)`` (x split on dim 0)
``reduce_scatter_tensor(out, t, op)``  ``reduce_scatter(x, op, group)``
``all_to_all_single(out, t)``          ``all_to_all(x, 0, 0, group)``
``send``/``recv``/``isend``/``irecv``  ``permute(x, perm, group)``, ``send_recv(x, shift)``
tutorial ring all-reduce               ``ring_all_reduce(x, axis_name, op)``
=====================================  =============================================

Not offered in-graph:

* ``barrier``: a traced program has no "everyone has arrived" point to wait for; the
  order of work is set by data dependencies and every collective already synchronises
  its participants. Use the eager ``jdist.barrier()`` between programs, or
  ``jax.block_until_ready`` on results.
* a lone ``send`` or ``recv``: inside one SPMD program both ends are one operation, so
  write the pair as :func:`permute` (``[(src, dst)]``) or :func:`send_recv`.
* ``async_op``: XLA schedules collectives asynchronously by itself.

Gradients: ``all_reduce`` (SUM, AVG, MIN, MAX, PRODUCT), ``broadcast``, ``reduce``,
``all_gather``, ``gather``, ``scatter``, ``reduce_scatter`` (SUM, AVG), ``all_to_all``,
``permute``, ``send_recv`` and ``ring_all_reduce`` are differentiable, under
``check_vma=True`` and ``False``. With ``check_vma=True``, results equal on every replica
(``all_reduce``, ``broadcast``, ``all_gather``, ``gather``) are typed invariant over the
axis and may leave ``shard_map`` with ``out_specs=P()``.
"""

from __future__ import annotations

from jdist.collectives._flat import all_reduce_flat as all_reduce_flat
from jdist.collectives._ring import ring_all_reduce as ring_all_reduce
from jdist.collectives._traced import all_gather as all_gather
from jdist.collectives._traced import all_gather_into_tensor as all_gather_into_tensor
from jdist.collectives._traced import all_reduce as all_reduce
from jdist.collectives._traced import all_to_all as all_to_all
from jdist.collectives._traced import axis_of as axis_of
from jdist.collectives._traced import broadcast as broadcast
from jdist.collectives._traced import gather as gather
from jdist.collectives._traced import permute as permute
from jdist.collectives._traced import reduce as reduce
from jdist.collectives._traced import reduce_scatter as reduce_scatter
from jdist.collectives._traced import reduce_scatter_tensor as reduce_scatter_tensor
from jdist.collectives._traced import scatter as scatter
from jdist.collectives._traced import send_recv as send_recv
from jdist.collectives._types import ReduceOp as ReduceOp

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_reduce_flat",
    "all_to_all",
    "axis_of",
    "broadcast",
    "gather",
    "permute",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "ring_all_reduce",
    "scatter",
    "send_recv",
]
