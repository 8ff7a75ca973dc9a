"""``DistributedDataParallel``: torch's DDP for Flax NNX modules (a thin shell).

The shell splits the module with ``nnx.split`` into parameters (``nnx.Param``) and
everything else ("buffers": batch statistics, RNG state, ...), builds pure functions
from the user's ``loss_fn(module, batch, ...)``, and hands them to the
:class:`~jdist.ddp._engine.Engine`, which runs one jitted ``shard_map`` program per step
and keeps the state torch keeps between steps. Results are written back into the
module (and the ``nnx.Optimizer``) in place.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from jdist.collectives.runtime import ProcessGroup
from jdist.ddp._binding import Binder, Binding
from jdist.ddp._binding import merge as _merge
from jdist.ddp._binding import split as _split
from jdist.ddp._buckets import LeafInfo
from jdist.ddp._shell import EngineShell
from jdist.ddp._torch_args import translate as torch_ddp_args
from jdist.ddp._untouched import keep_untouched

__all__ = ["DistributedDataParallel", "leaf_infos"]

def leaf_infos(params: Any) -> list[LeafInfo]:
    """Metadata (``"a/b/kernel"`` paths, shapes, dtypes, bytes) of a parameter tree."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        parts = []
        for k in path:
            name = getattr(k, "key", getattr(k, "idx", getattr(k, "name", None)))
            if name == "value" and isinstance(k, jax.tree_util.GetAttrKey):
                continue
            parts.append(str(name if name is not None else k))
        out.append(LeafInfo.of("/".join(parts), leaf))
    return out


class _StaticKey:
    """A program-cache key whose hash is computed once (hashing a GraphDef walks it)."""

    __slots__ = ("parts", "_hash")

    def __init__(self, *parts):
        self.parts = parts
        self._hash = hash(parts)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return isinstance(other, _StaticKey) and (
            self.parts is other.parts or self.parts == other.parts)


def _leaves_or_tree(tree: Any, treedef: Any) -> Any:
    """``tree``'s leaves when it has the structure read at bind time, else ``tree`` itself
    (the step added or removed variables: the binding writes it with ``nnx.update``)."""
    leaves, got = jax.tree.flatten(tree)
    return leaves if got == treedef else tree


def _sharded_optimizer(tx: Any, group: ProcessGroup) -> tuple[bool, dict]:
    """Whether ``tx`` shards its state (ZeRO: has ``state_partition_specs``) and the
    keyword arguments of its update inside DDP's train step.

    DDP's bucketed all-reduce averages the gradients; a ZeRO optimizer then only slices
    its shard (``average_gradients=False``), so gradients are averaged exactly once.
    """
    if not callable(getattr(tx, "state_partition_specs", None)):
        return False, {}
    tgroup = getattr(tx, "group", None)
    if tgroup is not None and (tgroup.mesh != group.mesh
                               or tgroup.axis_name != group.axis_name):
        raise ValueError(
            f"the optimizer shards its state over {tgroup.axis_name!r} on "
            f"{tgroup.mesh.devices.size} devices, but DDP runs over {group.axis_name!r} on "
            f"{group.mesh.devices.size}; build it with the DDP group "
            "(ZeroRedundancyOptimizer(tx, group=ddp.process_group))")
    return True, ({"average_gradients": False} if hasattr(tx, "average_gradients") else {})


_NODE_ARG_MSG = (
    "extra step argument #{i} is an NNX object ({kind}) whose state other than RNG "
    "streams the loss changes ({paths}); each replica would change it on its own shard "
    "of the batch, and DDP cannot tell how to combine the copies (metrics sum, other "
    "state may not). Pass nnx.Rngs (they advance as under nnx.jit) and read-only objects "
    "(a frozen teacher model) as step arguments; update metrics from the step's outputs "
    "(has_aux=True), or keep your own @nnx.jit step with ddp.shard_batch(batch), where "
    "metrics are computed over the global batch.")


class _NodeArgs:
    """The extra arguments of a step, with the NNX objects among them passed as their
    state and their RNG streams updated afterwards, as ``nnx.jit`` does: a dropout key
    drawn from an ``nnx.Rngs`` argument advances at every step. Other state may be read
    (a frozen teacher model); a loss that changes it (a metric's update) raises
    ``TypeError`` naming the fix when the step is traced.

    Every replica starts from the same state and advances it the same way (as a module's
    own ``nnx.Rngs``, whose state DDP broadcasts from replica 0); the object takes the
    first local replica's state after the step.
    """

    __slots__ = ("objs", "gdefs", "extra")

    def __init__(self, args: tuple):
        self.objs = [(i, a) for i, a in enumerate(args) if isinstance(a, nnx.Pytree)]
        extra, gdefs = list(args), []
        for i, a in self.objs:
            gdef, rngs, other = nnx.split(a, nnx.RngState, ...)
            gdefs.append((i, gdef))
            extra[i] = (rngs, other)
        self.gdefs, self.extra = tuple(gdefs), tuple(extra)

    @staticmethod
    def merge(gdefs: tuple, extra: tuple) -> tuple[tuple, list]:
        """Inside the step: the objects rebuilt from their states (and the list of them)."""
        if not gdefs:
            return extra, []
        extra, objs = list(extra), []
        for i, gdef in gdefs:
            extra[i] = _merge(gdef, *extra[i])
            objs.append(extra[i])
        return tuple(extra), objs

    @staticmethod
    def after(gdefs: tuple, extra: tuple, objs: list) -> list:
        """Inside the step, after the loss: each object's RNG state to write back;
        ``TypeError`` if the loss changed any other state of one."""
        out = []
        for (i, _), obj in zip(gdefs, objs, strict=True):
            _, rngs, other = nnx.split(obj, nnx.RngState, ...)
            before = extra[i][1]
            changed = [p for (p, a), b in zip(nnx.to_flat_state(before),
                                              jax.tree.leaves(other), strict=True)
                       if (a.get_raw_value() if hasattr(a, "get_raw_value") else a) is not b]
            if changed:
                raise TypeError(_NODE_ARG_MSG.format(i=i, kind=type(obj).__name__,
                                                     paths=changed[:5]))
            out.append(rngs)
        return out

    def write_back(self, aux: Any) -> Any:
        """Update the objects from the step's ``aux`` (stacked per local replica); return
        the user's ``aux``."""
        if not self.objs:
            return aux
        aux, states = aux
        for (_, obj), state in zip(self.objs, states, strict=True):
            nnx.update(obj, jax.tree.map(lambda x: x[0], state))
        return aux


def _static_inputs(inputs: tuple, kwargs: dict) -> tuple[tuple, Callable, tuple]:
    """Forward inputs as ``(arrays, rebuild, static)``: the array leaves to split over
    replicas, ``rebuild(arrays) -> (args, kwargs)``, and the other leaves with the tree
    structure (hashable: a program-cache key).

    Raises:
      TypeError: a non-array leaf cannot be hashed.
    """
    leaves, tdef = jax.tree.flatten((inputs, kwargs))
    is_array = [isinstance(x, (np.ndarray, jax.Array)) for x in leaves]
    static = tuple((i, x) for i, (x, a) in enumerate(zip(leaves, is_array, strict=True))
                   if not a)
    bad = next((x for _, x in static if not _static_ok(x)), None)
    if bad is not None:
        raise TypeError(
            f"ddp(...) passes non-array arguments to the module unchanged and compiles one "
            f"program per value, so they must be values that compare by content (strings, "
            f"numbers, flags, types, enums, functions); got a {type(bad).__name__} object. "
            "Register its type as a JAX pytree (jax.tree_util.register_dataclass) so its "
            "arrays are split over the replicas, or pass the arrays themselves")

    def rebuild(arrays: tuple) -> tuple:
        it = iter(arrays)
        out = [next(it) if a else x for x, a in zip(leaves, is_array, strict=True)]
        return jax.tree.unflatten(tdef, out)

    return tuple(x for x, a in zip(leaves, is_array, strict=True) if a), rebuild, (
        tdef, static)


def _static_ok(x: Any) -> bool:
    """Whether a non-array forward argument can key a compiled program: hashable by
    content (an object hashed by identity would compile a program per instance)."""
    try:
        hash(x)
    except TypeError:
        return False
    if isinstance(x, (type, enum.Enum)) or callable(x):
        return True
    return type(x).__hash__ is not object.__hash__


class DistributedDataParallel(EngineShell):
    """Data-parallel training of an NNX module with torch's DDP semantics.

    Args:
      module: a ``flax.nnx.Module``; its ``nnx.Param`` variables are trained, every other
        variable is a buffer (torch's buffers: batch stats, RNG state). Use
        :class:`FunctionalDDP` for Linen modules and plain parameter pytrees.
      process_group: the group to reduce over (default: the default group, or this
        process's local devices when ``init_process_group`` was not called).
      bucket_cap_mb: bucket size cap in MiB (default 25, with a 1 MiB first bucket).
      bucket_cap_mb_list: one cap per bucket in MiB, bucket 0 (reduced first) first, the
        last one repeating; takes precedence over ``bucket_cap_mb`` (torch 2.13).
      find_unused_parameters: reduce zeros for parameters that get no gradient instead
        of raising :class:`~jdist.errors.UnusedParametersError`.
      broadcast_buffers: take buffers from replica 0 at every forward (skipped right
        after a ``no_sync`` step, as torch).
      init_sync: check that every process has the same parameter tree and broadcast
        process 0's parameters and buffers.
      comm_hook: a comm hook ``hook(state, bucket)`` (state ``None``) or a
        ``(state, hook)`` pair; the same as calling :meth:`register_comm_hook`.
      compiler_options: XLA options for the step programs; ``None`` derives them from
        ``bucket_cap_mb`` (see :mod:`jdist.ddp._xla`), ``{}`` uses XLA's defaults.
      forward_sync_buffers: torch 2.13's name for ``broadcast_buffers`` (wins when both
        are given); unlike ``broadcast_buffers=False``, ``False`` here still broadcasts
        process 0's buffers at init, as torch.
      flat_buckets: whether to copy each bucket's gradients into one flat buffer when no
        comm hook is registered (torch's contiguous bucket; hooks always get flat
        buffers). Either way each bucket is reduced by one all-reduce fired from the
        backward pass. Without the copy, XLA's all-reduce combiner merges the bucket's
        gradients into one variadic all-reduce (see :mod:`jdist.ddp._xla`), which saves
        the copy on one process; but gloo runs a variadic all-reduce as one collective
        per array, so across processes on CPU the copy is much cheaper than the extra
        collectives (``benchmarks/ddp.py`` (b) times both). ``None`` (default): flat
        when the group spans several processes on CPU, no copy otherwise.
      **torch_args: torch's other arguments, so a ported ``DDP(...)`` call keeps them:
        ``device_ids``, ``output_device``, ``dim=0``, ``static_graph``,
        ``check_reduction``, ``skip_all_reduce_unused_params``, ``batched_grad_copy``
        are accepted (jdist does what they ask already), ``gradient_as_bucket_view=True``
        is ``flat_buckets=False``, and values asking for what jdist does not do raise
        ``ValueError`` naming the fix (see :mod:`jdist.ddp._torch_args`).

    After a step the module holds the new parameters as global arrays replicated over
    the group's devices; with several processes they span other processes' devices too
    (``np.asarray`` works, eager math on them does not: use ``ddp(x)`` for inference).

    Example::

      ddp = DistributedDataParallel(model)
      step = ddp.train_step(lambda m, b: loss(m(b["x"]), b["y"]), optimizer)
      for batch in loader:
          loss = step(batch)          # batch: this process's samples
    """

    def __init__(self, module: nnx.Module, *, process_group: ProcessGroup | None = None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 broadcast_buffers: bool = True, init_sync: bool = True,
                 comm_hook: Any = None, compiler_options: dict | None = None,
                 flat_buckets: bool | None = None, forward_sync_buffers: bool | None = None,
                 bucket_cap_mb_list: list[float] | None = None, **torch_args: Any):
        flat_buckets = torch_ddp_args(torch_args, flat_buckets)
        if not isinstance(module, nnx.Module):
            raise TypeError(
                f"DistributedDataParallel wraps a flax.nnx.Module, got {type(module).__name__}; "
                "for Linen modules or plain parameter pytrees use "
                "jdist.ddp.FunctionalDDP(params, ...) with an apply function")
        self.module = module
        _, params, buffers = _split(module)
        params, buffers, synced = self._start(
            leaf_infos(params), params, buffers, process_group=process_group,
            bucket_cap_mb=bucket_cap_mb, find_unused_parameters=find_unused_parameters,
            broadcast_buffers=broadcast_buffers, init_sync=init_sync, comm_hook=comm_hook,
            compiler_options=compiler_options, flat_buckets=flat_buckets,
            forward_sync_buffers=forward_sync_buffers, bucket_cap_mb_list=bucket_cap_mb_list)
        if synced:  # rank 0's values, uncommitted (see _sync.init_sync)
            nnx.update(module, params)
            nnx.update(module, buffers)

    # ------------------------------------------------------------------ info
    def replica_buffers(self) -> Any:
        """Buffers of this process's replicas, stacked on a leading axis (or ``None``).

        ``ddp.module`` shows the first local replica's; replicas differ after a
        ``no_sync`` step or with ``broadcast_buffers=False``.
        """
        from jdist.ddp._placement import local_rows

        st = self._engine.buf_stacked
        return None if st is None else local_rows(st)

    def _model_trees(self) -> tuple[Any, Any]:
        """The parameters and buffers (``nnx.State``), for the join post-hook."""
        _, params, buffers = _split(self.module)
        return params, buffers

    def _load_model_trees(self, params: Any, buffers: Any) -> None:
        """Write the join post-hook's values back (``buffers`` ``None``: kept)."""
        nnx.update(self.module, params)
        if buffers is not None:
            nnx.update(self.module, buffers)

    # ------------------------------------------------------------------ pure pieces
    def _loss(self, gdef, loss_fn: Callable, has_aux: bool, nodes: tuple = ()) -> Callable:
        """The pure loss of one replica. ``nodes``: the graphdefs of the NNX objects
        passed as extra arguments (``nnx.Rngs``; see :class:`_NodeArgs`), whose state
        goes in with the extra arguments and comes out after ``aux``."""

        def pure(params, buffers, batch, extra):
            m = _merge(gdef, params, buffers)
            args, objs = _NodeArgs.merge(nodes, extra)
            out = loss_fn(m, batch, *args)
            value, aux = out if has_aux else (out, None)
            _, _, new_buffers = _split(m)
            if nodes:
                aux = (aux, _NodeArgs.after(nodes, extra, objs))
            return value, (aux, new_buffers)

        return pure

    # ------------------------------------------------------------------ API
    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        """Forward over this process's batch (leading dimension), split over replicas.

        Array leaves of ``inputs`` and ``kwargs`` (numpy or JAX) are split over the
        replicas; every other leaf (a string, a flag, a type, ``None``) reaches the
        module unchanged, as torch's DDP passes non-tensor arguments through, and is part
        of the compiled program's key (it must be hashable).
        """
        gdef, params, buffers = _split(self.module)
        arrays, rebuild, static = _static_inputs(inputs, kwargs)
        key = ("call", gdef, static)

        def apply(p, b, xs):
            m = _merge(gdef, p, b)
            args, kw = rebuild(xs)
            out = m(*args, **kw)
            return out, _split(m)[2]

        out, new_buffers = self._engine.forward(key, apply, params, buffers, arrays)
        nnx.update(self.module, new_buffers)
        return out

    def value_and_grad(self, loss_fn: Callable, has_aux: bool = False) -> Callable:
        """``f(batch, *args) -> (loss, grads)`` with grads averaged over replicas.

        ``loss_fn(module, batch, *args)`` sees one replica's shard of the batch and
        returns a scalar (or ``(scalar, aux)`` with ``has_aux``). Gradients are reduced
        bucket by bucket from inside the backward pass and returned as an
        ``nnx.State`` of the parameters; ``loss`` is the mean over replicas, ``aux`` is
        stacked per local replica. Inside :meth:`no_sync` the call returns
        ``(loss, None)`` after accumulating this replica's gradients locally.
        """

        binder = Binder(self.module)

        def f(batch, *args):
            self._engine.remember(f, batch, args)
            b = binder.get()
            nodes = _NodeArgs(args)
            if ("vg", nodes.gdefs) not in b.cache:
                b.cache["vg", nodes.gdefs] = (
                    _StaticKey("vg", b.gdef, loss_fn, has_aux, nodes.gdefs),
                    self._loss(b.gdef, loss_fn, has_aux, nodes.gdefs))
            key, pure = b.cache["vg", nodes.gdefs]
            params, buffers = b.read(flat=False)
            out = self._engine.grad_step(key, pure, params, buffers, batch, nodes.extra)
            binder.write(b, out["buffers"])
            aux = nodes.write_back(out["aux"])
            value = (out["loss"], aux) if has_aux else out["loss"]
            return value, out["grads"]

        return self._joinable_step(f)  # numbered for join

    def train_step(self, loss_fn: Callable, optimizer: nnx.Optimizer,
                   has_aux: bool = False, pad_batch_to: Any = None,
                   donate: bool = True) -> Callable:
        """``step(batch, *args) -> loss``: forward, bucketed reduction, optimizer update.

        ``pad_batch_to`` (shape buckets, :mod:`jdist.ddp._padding`): every new batch
        shape compiles a new program; with an int (every batch padded to that many rows;
        the choice across processes) or a list of sizes (the smallest that fits; one
        process), variable-size batches compile once per size. ``loss_fn`` then returns
        one loss per example of its shard (``(losses, aux)`` with ``has_aux``) and the
        step's loss and gradients are exactly those of the mean over the real examples
        (layers mixing examples, like batch statistics, do see the zero padding).

        One jitted program per step; ``self.module`` and ``optimizer`` are updated in
        place. Inside :meth:`no_sync` gradients only accumulate (no update). With a
        :class:`~jdist.optim.ZeroRedundancyOptimizer` as ``tx`` (any ``tx`` with
        ``state_partition_specs``) the optimizer state stays sharded (1/N per replica);
        DDP averages the gradients and ZeRO only slices its shard of them.

        The step finds the module's and the optimizer's Variables at its first call and
        reads and writes them directly afterwards (no graph walk per step, as
        ``nnx.cached_partial``): values may change between steps (``nnx.update``,
        loading a checkpoint), but after replacing a submodule or a Variable object build
        a new step with ``train_step`` (torch likewise binds DDP to the parameters that
        exist when it is wrapped).

        ``donate`` (default): the step consumes the parameter and optimizer-state arrays
        DDP made (after its init sync or a previous step) and the optimizer's state as
        bound here, and writes the new values into their memory (one copy of each, as
        torch's in-place update); arrays from elsewhere (the module's own parameters on
        one process, ``nnx.update`` from another module or a checkpoint after this
        call) are copied first and stay valid. A reference kept to an array read from the
        module between steps raises "Array has been deleted" after the next step (torch
        would show the new value; a stale read would be silently wrong): keep
        ``jnp.copy`` / ``np.asarray`` of a value you need later, or pass
        ``donate=False`` (old and new arrays then coexist during a step).
        """
        if isinstance(optimizer, nnx.ModelAndOptimizer) or not isinstance(
                optimizer, nnx.Optimizer):
            raise TypeError(
                f"train_step needs an nnx.Optimizer(model, tx, wrt=nnx.Param), got "
                f"{type(optimizer).__name__}; build one with nnx.Optimizer(ddp.module, tx, "
                "wrt=nnx.Param)")

        if pad_batch_to is not None:
            return self._padded_step(loss_fn, optimizer, has_aux, pad_batch_to, donate)
        sharded, upd_kw = _sharded_optimizer(optimizer.tx, self.process_group)
        flat = not sharded  # a sharded (ZeRO) state needs its tree for its PartitionSpecs
        binder = Binder(self.module, optimizer)
        if donate:  # the optimizer's state is its own (see jdist/_donation.py), but
            # not the module's arrays it may hold (lookahead's slow weights at init)
            mine = {id(x) for x in jax.tree.leaves(nnx.state(self.module))}
            self._engine.donation.made([x for x in jax.tree.leaves(nnx.state(optimizer))
                                        if id(x) not in mine])

        def step(batch, *args):
            self._engine.remember(step, batch, args)
            b = binder.get()
            nodes = _NodeArgs(args)
            if ("train", nodes.gdefs) not in b.cache:
                b.cache["train", nodes.gdefs] = self._train_pieces(
                    b, loss_fn, has_aux, upd_kw, flat, nodes.gdefs)
            key, pure, update = b.cache["train", nodes.gdefs]
            params, buffers, ostate = b.read(flat)
            specs = optimizer.tx.state_partition_specs(ostate) if sharded else None
            out = self._engine.grad_step(key, pure, params, buffers, batch, nodes.extra,
                                         update=update, opt_state=ostate, opt_specs=specs,
                                         donate=donate)
            if self._engine.require_backward_grad_sync:
                binder.write(b, out["buffers"], out["params"], out["opt_state"])
            else:  # no_sync: gradients only accumulate, parameters stay
                binder.write(b, out["buffers"])
            aux = nodes.write_back(out["aux"])
            return (out["loss"], aux) if has_aux else out["loss"]

        return self._joinable_step(step)  # numbered for join

    def _padded_step(self, loss_fn: Callable, optimizer: nnx.Optimizer, has_aux: bool,
                     pad_batch_to: Any, donate: bool) -> Callable:
        """``train_step`` over batches padded to a few sizes, with an exact mask."""
        from jdist.ddp._padding import PadSizes, masked_mean, pad_batch

        g = self.process_group
        sizes = PadSizes(pad_batch_to, len(g.local_devices), g.size())
        inner = self.train_step(masked_mean(loss_fn, g.axis_name, has_aux), optimizer,
                                has_aux=has_aux, donate=donate)

        def step(batch, *args):
            return inner(pad_batch(batch, sizes), *args)

        return step

    def _train_pieces(self, b: Binding, loss_fn: Callable, has_aux: bool, upd_kw: dict,
                      flat: bool, nodes: tuple = ()) -> tuple:
        """``(key, loss, update)`` of a train step for binding ``b``.

        ``update(params, grads, opt_state, buffers, skip=()) -> (params, opt_state)`` runs
        ``nnx.Optimizer.update`` on a merged module, leaving the parameters ``skip`` (leaf indices
        without a gradient) and their optimizer state untouched. With ``flat`` (and a fast binding)
        both take and return flat lists of arrays, the ``State`` trees being rebuilt at trace time
        only, so a step neither builds nor flattens ``State`` objects in Python (about half of DDP's
        per-step host time).
        """
        gdef, ogdef = b.gdef, b.ogdef
        pure = self._loss(gdef, loss_fn, has_aux, nodes)

        def update(p, grads, os, bufs, skip=()):
            # the old values, apart: the merged objects share (and update) their Variables
            before = jax.tree.map(lambda x: x, (p, os)) if skip else (p, os)
            model = _merge(gdef, p, bufs)
            opt = nnx.merge(ogdef, os)
            opt.update(model, grads, **upd_kw)
            # parameters without a gradient: untouched, as torch's optimizers
            return keep_untouched(skip, before[0], _split(model)[1], before[1],
                                  nnx.split(opt)[1])

        key = _StaticKey("train", gdef, ogdef, loss_fn, has_aux, nodes)
        if not (flat and b.fast):
            return key, pure, update
        pt, bt, ot = b.treedefs

        def fpure(p, bufs, batch, extra):
            value, (aux, new_b) = pure(jax.tree.unflatten(pt, p), jax.tree.unflatten(bt, bufs),
                                       batch, extra)
            return value, (aux, _leaves_or_tree(new_b, bt))

        def fupdate(p, grads, os, bufs, skip=()):
            new_p, new_o = update(jax.tree.unflatten(pt, p), jax.tree.unflatten(pt, grads),
                                  jax.tree.unflatten(ot, os), jax.tree.unflatten(bt, bufs),
                                  skip)
            return _leaves_or_tree(new_p, pt), _leaves_or_tree(new_o, ot)

        return _StaticKey("flat", key, pt, bt, ot), fpure, fupdate
