"""ZeRO stage 1 (torch's ``ZeroRedundancyOptimizer``) as an optax-style transformation.

Each replica keeps only its shard of the optimizer state. Inside ``shard_map`` over
the group's axis, ``update(grads, state, params)``:

1. splits every parameter-shaped gradient ``g`` (rank >= 1) into ``N`` flat pieces of
   ``L = ceil(g.size / N)`` elements (row-major, zero-padded) and reduce-scatters
   (mean) them, one collective per dtype and bucket: replica ``i`` gets piece ``i`` of
   every leaf; rank-0 parameters are replicated (their gradients are averaged with ``pmean``);
2. runs the wrapped ``tx`` on those pieces *without ever showing it a tree of pieces*:
   ``tx.update`` is traced on the real (full, abstract) tree, so masks given as
   pytrees or callables, ``multi_transform`` labels and per-leaf settings see the real
   leaves, and the traced program is replayed on the pieces
   (:mod:`jdist.optim._zero_replay`): element-wise steps run on the pieces, whole-leaf
   and global norms (``clip_by_global_norm``, LAMB/LARS trust ratios) finish with a
   collective, and anything that mixes elements across pieces (Adafactor's factored
   moments, matrix products, per-leaf noise) raises
   :class:`~jdist.optim._zero_replay.NonSeparableTransformError`;
3. all-gathers the updated pieces, so every replica returns the full update tree.

So ZeRO gives the unsharded optimizer's result (up to the order of float sums in
global norms) or a named error; never a silently different one.

The collectives run per dtype in buckets of consecutive leaves of at most
``bucket_cap_mb`` MiB of full parameters (default 25, DDP's): a bucket's concatenated
pieces and its gathered result are the only temporaries the collectives add, so a
step's peak memory grows by 1.5 buckets, not by 1.5 times the parameters
(:mod:`jdist.optim._zero_comm`).

Partitioning differs from torch on purpose: torch assigns *whole* parameters to ranks
greedily (largest first, to the least-loaded rank), so shards are unbalanced by up to
one parameter and a single huge parameter is not sharded at all. jdist splits every
leaf evenly (at most ``N - 1`` padding elements per leaf), and the collectives run per
bucket.

With DDP (gradients already averaged) pass ``average_gradients=False``: each replica
then slices its pieces locally instead of reduce-scattering. Inside
``DistributedDataParallel.train_step`` with ``nnx.Optimizer(model, zero, wrt=nnx.Param)``
DDP's bucketed all-reduce does the averaging and the step calls
``update(..., average_gradients=False)``, and shards the optimizer state with
:meth:`~ZeroRedundancyOptimizer.state_partition_specs`.

Outside ``shard_map`` the state is a pytree of global arrays with the structure of
``tx.init(params)``: each rank >= 1 leaf of full shape ``S`` is stored flat, of shape
``(N * L,)``, sharded over the axis (data first, zero padding last); rank-0 leaves
(Adam's ``count``) are replicated. ``init`` called outside ``shard_map`` builds that
global state directly (so ``nnx.Optimizer(model, zero)`` works); inside it returns the
local shard state.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdist._donation import Donation
from jdist.algorithms.join import Join, Joinable
from jdist.collectives.runtime import ProcessGroup, bound_size, is_bound, resolve_group
from jdist.optim._param_groups import ParamGroupsState, check_param_group, groups_of
from jdist.optim._zero_comm import gather_shards, grad_shards
from jdist.optim._zero_comm import length as _length
from jdist.optim._zero_join import ZeroJoinHook
from jdist.optim._zero_replay import NonSeparableTransformError, ShardReplayer
from jdist.optim._zero_state import full_state, full_state_like, resize_leaf, sharded_state

__all__ = ["NonSeparableTransformError", "ZeroRedundancyOptimizer", "ZeroState",
           "flat_partition"]


class ZeroState(NamedTuple):
    """``inner``: the wrapped transformation's state, rank >= 1 leaves as flat shards."""

    inner: Any


class _Layout(NamedTuple):
    treedef: Any
    shapes: tuple
    dtypes: tuple
    paths: tuple
    groups: tuple  # ((key, dtype, leaf indices, total numel, elements per replica), ...)


def _check_leaves(leaves_p) -> None:
    """torch's TypeError for parameters that are not arrays (``1.2``, ``[1, w]``)."""
    for path, x in leaves_p:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(
                f"ZeroRedundancyOptimizer can only optimize arrays, but the parameter at "
                f"{jax.tree_util.keystr(path) or 'the root'} is {type(x).__name__} {x!r}; "
                "pass a pytree of jax/numpy arrays (e.g. nnx.state(model, nnx.Param))")


def flat_partition(params, num_replicas: int) -> _Layout:
    """The partition of ``params`` over ``num_replicas`` (static): per dtype, the leaves
    of rank >= 1, their total size and the elements each replica holds."""
    leaves_p, treedef = jax.tree_util.tree_flatten_with_path(params)
    if not leaves_p:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    _check_leaves(leaves_p)
    paths = tuple(p for p, _ in leaves_p)
    shapes = tuple(tuple(np.shape(x)) for _, x in leaves_p)
    dtypes = tuple(jnp.dtype(x.dtype) for _, x in leaves_p)
    groups = []
    for dt in sorted(set(dtypes), key=str):
        idxs = tuple(i for i, d in enumerate(dtypes) if d == dt and shapes[i])
        if idxs:
            groups.append((str(dt), dt, idxs, sum(math.prod(shapes[i]) for i in idxs),
                           sum(_length(shapes[i], num_replicas) for i in idxs)))
    return _Layout(treedef, shapes, dtypes, paths, tuple(groups))


def _describe(tx) -> str:
    fn = getattr(tx, "update", None)
    name = getattr(fn, "__qualname__", type(tx).__name__).split(".<locals>")[0]
    return f"{getattr(fn, '__module__', '')}.{name}".lstrip(".")


class ZeroRedundancyOptimizer(Joinable):
    """ZeRO-1 wrapper of an optax transformation (``init``/``update`` like optax).

    Args:
      tx: the optax transformation whose state is sharded.
      group: ProcessGroup (or None: the default/embedded group); its mesh and axis.
      average_gradients: reduce-scatter (mean) the gradients; ``False`` when they are
        already averaged (DDP).
      bucket_cap_mb: the most MiB of (full) parameters one collective carries; bigger
        buckets mean fewer collectives and more temporary memory (module doc).

    torch's surface around the pure pair: :meth:`step` / :meth:`closure_step` (eager),
    ``consolidate_state_dict`` / ``state_dict`` / ``load_state_dict``, and, with a
    :class:`~jdist.optim.ParamGroups` ``tx``, :meth:`param_groups` and
    :meth:`add_param_group`. It is a :class:`~jdist.algorithms.join.Joinable`
    (:mod:`jdist.optim._zero_join`).
    """

    def __init__(self, tx, *, group: ProcessGroup | None = None, average_gradients=True,
                 bucket_cap_mb: float = 25.0):
        if not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise TypeError(f"ZeroRedundancyOptimizer expects an optax GradientTransformation, "
                            f"got {type(tx).__name__}; pass e.g. optax.adam(1e-3)")
        self.cap_bytes = _cap_bytes(bucket_cap_mb)
        self.tx = tx
        self.group = resolve_group(group)
        self.axis = self.group.axis_name
        self.num_replicas = self.group.num_replicas
        self.average_gradients = bool(average_gradients)
        self.layout: _Layout | None = None
        self._consolidated: dict | None = None
        self._steps: dict = {}
        super().__init__()
        self.latest = None  # (params, state) of the last eager step (the join hook's)
        self._donation = Donation()  # what an eager step may consume
        self.join_grads = None  # what a joined process steps with (a tree or a callable)

    # ---- the pure transformation -------------------------------------------------
    def _layout_for(self, params) -> _Layout:
        """The partition of ``params``: static (shapes, dtypes and tree structure only).
        Only the eager entry points (``init`` outside ``shard_map``, ``init_global``,
        ``step``) remember it in :attr:`layout`, for the state dicts."""
        layout = flat_partition(params, self.num_replicas)
        # shapes and dtypes only: nnx.Optimizer's init sees Param Variables, its update
        # the bare arrays of the same tree (the treedefs differ, the partition does not)
        if self.layout is not None and (layout.shapes, layout.dtypes) != (
                self.layout.shapes, self.layout.dtypes):
            raise ValueError("this ZeroRedundancyOptimizer was initialized for other "
                             "parameters; make one optimizer per parameter tree")
        return layout

    def _replayer(self) -> ShardReplayer:
        return ShardReplayer(self.axis, self.num_replicas, _describe(self.tx))

    def _init_local(self, params):
        rep = self._replayer()
        closed, shape = jax.make_jaxpr(self.tx.init, return_shape=True)(params)
        leaves = jax.tree.leaves(params)
        outs = rep.run(closed, [rep.shard(x) for x in leaves], [np.ndim(x) > 0 for x in leaves])
        state = [rep.zero_padding(rep.local(o), a.shape)
                 for o, a in zip(outs, jax.tree.leaves(shape), strict=True)]
        return ZeroState(jax.tree.unflatten(jax.tree.structure(shape), state))

    def init(self, params) -> ZeroState:
        """Local shard state inside ``shard_map``; the global sharded state outside."""
        if not is_bound(self.axis):
            return self.init_global(params)
        self._layout_for(params)  # checked; remembered only by the eager entry points
        return self._init_local(params)

    def init_global(self, params) -> ZeroState:
        """The state as global arrays sharded over the group's mesh (call outside shard_map)."""
        self.layout = self._layout_for(params)
        specs = self.state_partition_specs(self._state_shapes())
        fn = jax.jit(jax.shard_map(self._init_local, mesh=self.group.mesh,
                                   in_specs=(P(),), out_specs=specs, check_vma=False))
        state = fn(_replicated(params, self.group.mesh))
        self._donation.made(state)  # the optimizer's own: its steps consume it
        return state

    def update(self, grads, state: ZeroState, params=None, *,
               average_gradients: bool | None = None, **extra):
        """Inside ``shard_map``: reduce-scatter, replayed update, all-gather (module doc).

        ``average_gradients`` overrides the constructor's setting for this call (DDP's
        train step passes ``False``: its all-reduce already averaged the gradients).
        """
        average = self.average_gradients if average_gradients is None else bool(
            average_gradients)
        return self._update(grads, state, params, average, **extra)

    def step(self, params, grads, state: ZeroState, **extra):
        """Outside ``shard_map``: one ZeRO step with *already averaged* gradients.

        The torch pattern with DDP: DDP all-reduces the gradients, then each replica
        updates its shard and the shards are all-gathered. ``params`` and ``grads`` are
        replicated trees (e.g. ``nnx.state(model, nnx.Param)`` and the grads from
        ``ddp.value_and_grad``); returns ``(new_params, new_state)``. ``extra``: keyword
        arguments of ``tx.update`` (torch's ``step(**kwargs)``; optax's extra args).
        The step consumes the arrays this optimizer made (the state from :meth:`init`,
        the parameters and state a previous step returned) and writes the new values
        into them, as torch's in-place step; other arrays (your initial parameters) are
        copied first and stay valid (``jdist/_donation.py``).
        Inside a :class:`~jdist.algorithms.join.Join` it first notifies the context.
        """
        Join.notify_join_context(self)
        return _eager_step(self, params, grads, state, extra)

    def closure_step(self, closure, params, state: ZeroState, **extra):
        """torch's ``step(closure)``: ``closure(params)`` returns ``(loss, grads)``
        (gradients averaged over the replicas, as DDP's), then :meth:`step`.

        Returns ``(new_params, new_state, loss)``.
        """
        out = closure(params)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError("closure_step's closure must return (loss, grads), e.g. "
                            f"jax.value_and_grad(loss_fn)(params); got {type(out).__name__}")
        loss, grads = out
        return (*self.step(params, grads, state, **extra), loss)

    def _update(self, grads, state, params, average, **extra):
        if params is None:
            raise ValueError("ZeroRedundancyOptimizer.update needs params (to slice this "
                             "replica's shard); call update(grads, state, params)")
        if not isinstance(state, ZeroState):
            raise TypeError(f"expected the ZeroState from ZeroRedundancyOptimizer.init, got "
                            f"{type(state).__name__}")
        bound_size(self.axis, "ZeroRedundancyOptimizer.update",
                   f"It must run inside jax.shard_map over the group's mesh axis "
                   f"{self.axis!r}; outside it, use zero.step(params, grads, state)")
        self._layout_for(params)
        rep = self._replayer()
        full = self._full_state_like(params, state.inner)
        closed, shape = jax.make_jaxpr(
            lambda g, s, p, e: self.tx.update(g, s, p, **e), return_shape=True)(
            grads, full, params, extra)
        g, st, p = (jax.tree.leaves(t) for t in (grads, state.inner, params))
        e = jax.tree.leaves(extra)
        args = grad_shards(g, average, rep, self.axis, self.cap_bytes) + st + \
            [rep.shard(x) for x in p] + e
        sharded = [np.ndim(x) > 0 for x in g + st + p] + [False] * len(e)
        outs = rep.run(closed, args, sharded)
        avals = jax.tree.leaves(shape)
        k = len(jax.tree.leaves(shape[0]))
        updates = gather_shards(outs[:k], avals[:k], self.axis, self.num_replicas,
                                self.cap_bytes)
        new = [rep.zero_padding(rep.local(o), a.shape)
               for o, a in zip(outs[k:], avals[k:], strict=True)]
        return (jax.tree.unflatten(jax.tree.structure(shape[0]), updates),
                ZeroState(jax.tree.unflatten(jax.tree.structure(shape[1]), new)))

    def _full_state_like(self, params, inner):
        """Abstract full-shaped state with the structure of ``inner`` (for tracing)."""
        return full_state_like(jax.eval_shape(self.tx.init, params), inner,
                               self.num_replicas)

    # ---- sharding helpers ----------------------------------------------------------
    def _params_struct(self):
        lay = self.layout
        return jax.tree.unflatten(lay.treedef, [jax.ShapeDtypeStruct(s, d) for s, d in
                                                zip(lay.shapes, lay.dtypes, strict=True)])

    def _state_shapes(self) -> ZeroState:
        """Global shapes of the sharded state (rank >= 1 leaves flat, ``N * L``)."""
        n = self.num_replicas
        return ZeroState(jax.tree.map(
            lambda r: jax.ShapeDtypeStruct((n * _length(r.shape, n),) if r.shape else (),
                                           r.dtype),
            jax.eval_shape(self.tx.init, self._params_struct())))

    def state_partition_specs(self, state) -> Any:
        """PartitionSpecs for ``state`` outside ``shard_map``: flat shards (rank 1) on
        the axis, scalars ``P()``.

        Also works on the state of an ``nnx.Optimizer`` built around this optimizer
        (``nnx.split(optimizer)[1]``): a training step that shards its optimizer state
        with these specs keeps 1/N of it per replica.
        """
        return jax.tree.map(lambda x: P(self.axis) if np.ndim(x) == 1 else P(), state)

    def state_shardings(self, state) -> Any:
        """NamedShardings for ``state`` on the group's mesh (for ``jax.jit``)."""
        return jax.tree.map(lambda s: NamedSharding(self.group.mesh, s),
                            self.state_partition_specs(state))

    # ---- state dicts (torch's API) -------------------------------------------------
    def consolidate_state_dict(self, state: ZeroState, to: int = 0) -> None:
        """Collect the full (unsharded) state on group rank ``to``; call on all ranks.

        Every process takes part (the shards are gathered from all of them); only rank
        ``to`` keeps the result, which :meth:`state_dict` then returns. ``state`` is this
        optimizer's state (a ``ZeroState``, or an ``nnx.Optimizer``'s ``opt_state``).
        """
        if not 0 <= to < self.group.size():
            raise ValueError(f"to={to!r} is not a rank of the group (size "
                             f"{self.group.size()}); pass 0 <= to < {self.group.size()}")
        self._need_layout("consolidate_state_dict")
        host = [_to_host(x) for x in jax.tree.leaves(state)]
        full = full_state(jax.eval_shape(self.tx.init, self._params_struct()), host)
        self._consolidated = ({"state": full, "param_groups": self.param_groups(full),
                               "num_replicas": self.num_replicas}
                              if self.group.rank == to else None)

    def state_dict(self) -> dict:
        """The state collected by :meth:`consolidate_state_dict` on this rank.

        ``state`` has the structure ``tx.init(params)`` would have without ZeRO (numpy
        leaves), so it loads into an unsharded optimizer or a ZeRO of another size.
        """
        if self._consolidated is None:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. "
                f"Please call `consolidate_state_dict(to={self.group.rank})` on "
                "all ranks beforehand if you meant to save the global state."
            )
        return self._consolidated

    def load_state_dict(self, state_dict) -> ZeroState:
        """The sharded state for a full state (each replica keeps its shard).

        ``state_dict``: a dict from :meth:`state_dict` (its ``'state'``), or the full
        state of an unsharded optimizer: ``tx.init(params)``'s tree, a plain
        ``nnx.Optimizer``'s ``opt_state`` or ``nnx.state(optimizer)``. Leaves are matched
        by their path (``.value`` of nnx Variables ignored). Returns the new state (jdist
        states are values; torch loads in place).
        """
        self._need_layout("load_state_dict")
        tree = state_dict["state"] if isinstance(state_dict, dict) and "state" in \
            state_dict else state_dict
        if isinstance(tree, ZeroState):
            tree = tree.inner
        flat = sharded_state(jax.eval_shape(self.tx.init, self._params_struct()), tree,
                             self.num_replicas)
        specs = self.state_partition_specs(flat)
        return ZeroState(jax.tree.map(
            lambda x, s: _global(x, NamedSharding(self.group.mesh, s)), flat, specs))

    # ---- torch's param groups and Joinable ------------------------------------------
    def param_groups(self, state) -> list[dict]:
        """torch's ``param_groups`` (without ``"params"``): the hyperparameters in
        ``state`` (see :func:`jdist.optim.param_groups`; all settings of each group
        with a :class:`~jdist.optim.ParamGroups` ``tx``)."""
        return groups_of(self.tx, state.inner if isinstance(state, ZeroState) else state)

    def add_param_group(self, param_group: dict, state: ZeroState) -> ZeroState:
        """torch's ``add_param_group``: ``{"params": pytree, **hyperparameters}``.

        ``tx`` must be a :class:`~jdist.optim.ParamGroups`; the new group's state is
        initialized sharded and appended (the others are kept). Returns the new state;
        the parameters passed to later steps are the old list plus
        ``param_group["params"]``.
        """
        check_param_group(self.tx, param_group, _describe(self.tx))
        self._need_layout("add_param_group")
        tx = self.tx.add_param_group({k: v for k, v in param_group.items() if k != "params"})
        group_params = param_group["params"]
        piece = ZeroRedundancyOptimizer(tx.transformation(-1), group=self.group,
                                        average_gradients=self.average_gradients,
                                        bucket_cap_mb=self.cap_bytes / (1 << 20))
        inner = piece.init_global(group_params).inner
        params = list(self._params_struct()) + [group_params]
        self.tx, self._steps, self.layout = tx, {}, flat_partition(params, self.num_replicas)
        state = state.inner if isinstance(state, ZeroState) else state
        return ZeroState(ParamGroupsState(tuple(state.groups) + (inner,)))

    def join_hook(self, **kwargs) -> ZeroJoinHook:
        """The hook a joined process runs: one :meth:`step` per iteration of the others
        (with ``self.join_grads``; see :mod:`jdist.optim._zero_join`)."""
        del kwargs
        return ZeroJoinHook(self, functools.partial(_eager_step, self))

    @property
    def join_device(self):
        return next(d for d in self.group.mesh.devices.flat
                    if d.process_index == jax.process_index())

    @property
    def join_process_group(self):
        return self.group

    @staticmethod
    def resize_state_leaf(saved, length: int) -> np.ndarray:
        """A stored flat state leaf re-split for another replica count (see
        :func:`jdist.optim._zero_state.resize_leaf`)."""
        return resize_leaf(saved, length)

    def _need_layout(self, what: str) -> None:
        if self.layout is None:
            raise ValueError(f"call init(params) before {what} (the partition comes from "
                             "the parameters)")


def _eager_step(self: ZeroRedundancyOptimizer, params, grads, state, extra: dict):
    """:meth:`ZeroRedundancyOptimizer.step`'s compiled step (cached per tree
    structure), consuming what the optimizer made (``jdist/_donation.py``)."""
    self.layout = self._layout_for(params)
    mesh = self.group.mesh
    specs = self.state_partition_specs(state)
    key = (jax.tree.structure(params), jax.tree.structure(state),
           jax.tree.structure(extra))
    fn = self._steps.get(key)
    if fn is None:
        def body(p, g, s, e):
            u, s = self._update(g, s, p, False, **e)
            return jax.tree.map(lambda a, b: (a + b).astype(a.dtype), p, u), s

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), specs, P()),
                                   out_specs=(P(), specs), check_vma=False),
                     donate_argnums=(0, 2))
        self._steps[key] = fn
    seen: set[int] = set()  # arrays this optimizer did not make are copied first
    placed = self._donation.own(_on_mesh(params, mesh), params, seen)
    state = self._donation.own(state, state, seen)
    self.latest = fn(placed, _on_mesh(grads, mesh), state, _on_mesh(extra, mesh))
    self._donation.made(self.latest, replace=True)
    return self.latest


def _cap_bytes(bucket_cap_mb) -> int:
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
            or not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got "
                         f"{bucket_cap_mb!r}; pass e.g. bucket_cap_mb=25")
    return max(1, int(min(bucket_cap_mb * (1 << 20), 1 << 62)))


def _on_mesh(tree, mesh):
    """Leaves as arrays replicated on ``mesh`` (kept if already there)."""
    def one(x):
        sh = getattr(x, "sharding", None)
        if isinstance(sh, NamedSharding) and sh.mesh == mesh and sh.is_fully_replicated:
            return x
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            raise ValueError("step() needs replicated parameters and gradients on the "
                             "optimizer's mesh, got an array sharded over other devices")
        return _global(np.asarray(x), NamedSharding(mesh, P()))

    return jax.tree.map(one, tree)


def _replicated(tree, mesh):
    return jax.tree.map(lambda x: _global(np.asarray(x), NamedSharding(mesh, P())), tree)


def _global(x: np.ndarray, sharding):
    if _is_key(x):
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _to_host(x):
    if _is_key(x):  # PRNG key state (add_noise): kept as a (replicated) key array
        return x if x.is_fully_addressable else x.addressable_data(0)
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
