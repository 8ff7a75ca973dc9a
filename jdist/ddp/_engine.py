"""The DDP engine: state kept between steps and the calls into the jitted programs.

Shared by the NNX shell (:class:`jdist.ddp.DistributedDataParallel`) and the functional
entry point (:class:`jdist.ddp.FunctionalDDP`). It owns the bucket layout (rebuilt once in
gradient-ready order at the first trace), the comm hook and its state (a
:class:`~jdist.ddp._hookslot.HookSlot`), the gradients accumulated under ``no_sync()``
(and which parameters they hold gradients for), the per-replica buffers, and a cache of
compiled programs. Everything it runs is a pure program from :mod:`jdist.ddp._program`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jdist._donation import Donation
from jdist.collectives import prefers_flat
from jdist.collectives.runtime import ProcessGroup
from jdist.ddp import _buckets, _placement, _program, _reducer
from jdist.ddp._buckets import BucketLayout, LeafInfo
from jdist.ddp._hookslot import HookSlot
from jdist.ddp._replicas import ProcessChecks
from jdist.ddp._untouched import SkipTracker
from jdist.ddp._xla import bucket_compiler_options
from jdist.ddp.hooks._contract import raise_hook_failure
from jdist.errors import UnusedParametersError

__all__ = ["Engine", "TRACED_MSG"]


def _block_on_one(out: Any, num_devices: int) -> None:
    """Wait for one program execution: on an output with a shard on each of its devices."""
    leaves = jax.tree.leaves(out)
    for x in leaves:
        if isinstance(x, jax.Array) and len(x.sharding.device_set) == num_devices:
            x.block_until_ready()
            return
    jax.block_until_ready(leaves)


TRACED_MSG = (
    "{what} got traced values (it is being called inside jax.grad / jax.vjp / jax.jit, "
    "e.g. by a dist_autograd.backward loss function). DDP runs its own compiled program "
    "over the replica mesh, with the gradient all-reduce inside, so it cannot be traced "
    "into another computation. Inside dist_autograd.backward wrap the DDP module and its "
    "loss as one differentiable stage: stage = jdist.rpc.dist_autograd.ddp_stage(ddp, "
    "lambda module, x, y: criterion(module(x), y)), then call loss = stage(x, y) in the "
    "loss function (its gradients are DDP-averaged into the context); elsewhere call "
    "ddp.value_and_grad(loss_fn) or ddp.train_step(loss_fn, optimizer) with concrete "
    "arrays, outside any jax transformation.")


def _check_concrete(what: str, *trees: Any) -> None:
    """Raise the ``ddp_stage`` hint when a DDP program is called with tracers."""
    for tree in trees:
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree)):
            raise TypeError(TRACED_MSG.format(what=what))


class Engine:
    """Bucket layout, hook, accumulated gradients and buffers of one DDP wrapper."""

    def __init__(self, group: ProcessGroup, leaves: Sequence[LeafInfo], *,
                 bucket_cap_mb: float | None, find_unused_parameters: bool,
                 broadcast_buffers: bool, compiler_options: dict | None = None,
                 flat_buckets: bool | None = None):
        self.group = group
        self.leaves = tuple(leaves)
        self.bucket_cap_mb = bucket_cap_mb
        self.find_unused = bool(find_unused_parameters)
        self.broadcast_buffers = bool(broadcast_buffers)
        self.layout: BucketLayout = _buckets.initial_layout(
            self.leaves, bucket_cap_mb, self.find_unused)
        self.hooks = HookSlot()
        self.require_backward_grad_sync = True
        self.last_synced = True  # torch's require_forward_param_sync
        self.acc: Any = None  # per replica, from no_sync steps
        self.acc_had_grad: frozenset = frozenset()  # leaves with a gradient in self.acc
        self.skipped = SkipTracker([leaf.path for leaf in self.leaves])
        self.buf_stacked: Any = None
        self.buf_view: list | None = None
        self.steps = 0
        self.join_state: Any = None
        self._programs: dict = {}
        self._records: dict = {}  # program key -> what its trace found (unused leaves)
        self._warned_unused = False
        self.checks = ProcessChecks(group)  # across processes: batch sizes, replicas
        self.donation = Donation()  # the arrays a train step may consume (jdist/_donation.py)
        self._user_options = None if compiler_options is None else dict(compiler_options)
        if flat_buckets is None:  # see DistributedDataParallel's flat_buckets
            flat_buckets = prefers_flat(self._platform, group.size())
        self.flat_buckets = bool(flat_buckets)

    @property
    def compiler_options(self) -> dict:
        """XLA options of the step programs: the user's, or derived (``_xla.py``)."""
        if self._user_options is not None:
            return dict(self._user_options)
        flat = self.flat_buckets or self.hooks.hook is not None
        largest = max((b.nbytes for b in self.layout.buckets), default=0)
        return bucket_compiler_options(self.bucket_cap_mb, self._platform, combine=not flat,
                                       largest_bucket=largest)

    @property
    def _platform(self) -> str:
        return self.group.mesh.devices.flat[0].platform

    def _config(self) -> _program.Config:
        return _program.Config(
            mesh=self.group.mesh, axis=self.group.axis_name,
            num_replicas=self.group.num_replicas, layout=self.layout,
            hook=self.hooks.traced(), find_unused=self.find_unused,
            compiler_options=self.compiler_options, flat_buckets=self.flat_buckets)

    # ----------------------------------------------------------------- layout
    def ensure_layout(self, loss: Callable, params, buffers, batch, extra) -> None:
        """Rebuild buckets in gradient-ready order, recorded by tracing (once)."""
        if self.layout.rebuilt:
            return
        if self.find_unused:
            self._check_find_unused(loss, params, buffers, batch, extra)
            return
        seen: dict = {}

        def record(f, p, args):
            seen["order"], seen["unused"] = _reducer.record_ready_order(
                f, p, args, self.group.axis_name)

        prog = _program.ready_order_program(self._config(), loss, record)
        jax.eval_shape(prog, params, buffers, batch, extra)
        if seen["unused"]:
            raise UnusedParametersError(_reducer.unused_message(
                [self.leaves[j].path for j in seen["unused"]]))
        # programs built so far (forward, no_sync) never reduce, so they stay valid
        self.layout = _buckets.rebuilt_layout(self.leaves, seen["order"], self.bucket_cap_mb)

    def _check_find_unused(self, loss, params, buffers, batch, extra) -> None:
        if self._warned_unused:
            return
        seen: dict = {}

        def record(f, p, args):
            _, seen["unused"] = _reducer.record_ready_order(f, p, args, self.group.axis_name)

        jax.eval_shape(_program.ready_order_program(self._config(), loss, record),
                       params, buffers, batch, extra)
        self._warned_unused = True
        if not seen["unused"]:
            warnings.warn(
                "find_unused_parameters=True was specified in DDP constructor, but did not "
                "find any unused parameters in the forward pass. In jdist the flag costs no "
                "extra communication, but the bucket layout is not rebuilt in gradient-ready "
                "order; pass find_unused_parameters=False if no parameter goes unused.",
                stacklevel=4)

    # ----------------------------------------------------------------- buffers
    def buffers_in(self, module_buffers: Any) -> Any:
        """Per-replica buffers for the next program: kept ones, or the module's."""
        leaves = jax.tree.leaves(module_buffers)
        if self.buf_view is not None and len(leaves) == len(self.buf_view) and all(
                a is b for a, b in zip(leaves, self.buf_view, strict=False)):
            # kept as a flat list by a flat train step, or as a tree by the other programs
            kept = self.buf_stacked
            if isinstance(module_buffers, list) and not isinstance(kept, list):
                return jax.tree.leaves(kept)
            if isinstance(kept, list) and not isinstance(module_buffers, list):
                return jax.tree.unflatten(jax.tree.structure(module_buffers), kept)
            return kept
        return _placement.per_replica(module_buffers, self.group)

    def buffers_out(self, stacked: Any) -> Any:
        """Keep per-replica buffers; return the first local replica's for the module,
        replicated over the group's devices like the parameters (so that the user's own
        ``jit`` programs over the module, an ``eval_step``, see one placement)."""
        self.buf_stacked = stacked
        view = _placement.replicated(_placement.local_first(stacked), self.group)
        self.buf_view = jax.tree.leaves(view)
        return view

    @property
    def sync_buffers(self) -> bool:
        return self.broadcast_buffers and self.last_synced

    # ----------------------------------------------------------------- programs
    def grad_step(self, key: Any, loss: Callable, params: Any, module_buffers: Any,
                  batch: Any, extra: tuple, update: Callable | None = None,
                  opt_state: Any = None, opt_specs: Any = None, donate: bool = False) -> dict:
        """Run one gradient (or train) step; returns the program's outputs by name.

        ``opt_specs``: PartitionSpecs of a sharded optimizer state (ZeRO), ``None`` for a
        replicated one. ``donate``: a train step consumes the parameters, optimizer
        state and comm-hook state it replaces (``jdist/_donation.py``); accumulated
        ``no_sync`` gradients are always consumed.
        """
        g = self.group
        sync = self.require_backward_grad_sync
        _check_concrete("ddp.value_and_grad / ddp.train_step", params, batch, extra)
        module_params, params = params, _placement.replicated(params, g)
        # (under join, joined processes could not pair it)
        self.checks.replicas(module_params, params, collective=self.join_state is None)
        held_opt, opt_state = opt_state, (_placement.replicated(opt_state, g)
                                          if opt_specs is None
                                          else _placement.with_specs(opt_state, opt_specs, g))
        extra = _placement.replicated(tuple(extra), g)
        self.checks.rows(batch)
        batch = _placement.shard_batch(batch, g)
        buffers = self.buffers_in(module_buffers)
        if sync:
            self.ensure_layout(loss, params, buffers, batch, extra)
            self.hooks.prepare(self.layout, self.leaves, self.group)
        if self.acc is not None and isinstance(self.acc, list) != isinstance(params, list):
            # accumulated by a flat train step, used by a tree step (or the reverse)
            self.acc = (jax.tree.leaves(self.acc) if isinstance(params, list) else
                        jax.tree.unflatten(jax.tree.structure(params), self.acc))
        has_acc = self.acc is not None
        js = self.join_state
        mode = None if js is None else js.mode
        had_grad = self.acc_had_grad if has_acc and sync else frozenset()
        donating = donate and update is not None and sync
        run_params, hstate = params, self.hooks.state
        if donating:  # copies of what DDP did not make (jdist/_donation.py)
            seen: set[int] = set()
            run_params = self.donation.own(params, module_params, seen)
            opt_state = self.donation.own(opt_state, held_opt, seen)
            hstate = self.donation.own(hstate, hstate, seen)
        pkey = ("grad", key, sync, self.sync_buffers, has_acc, update is not None, mode,
                opt_specs is not None, had_grad, donating)
        prog, record = self._programs.get(pkey), self._records.setdefault(pkey, {})
        if prog is None:
            prog = _program.grad_program(self._config(), loss, update, sync=sync,
                                         sync_buffers=self.sync_buffers, has_acc=has_acc,
                                         join=mode, opt_specs=opt_specs, had_grad=had_grad,
                                         record=record, donate=donating)
            self._programs[pkey] = prog
        active = None if js is None else _placement.per_replica(
            jax.numpy.float32(1.0 if js.active else 0.0), g)
        out = self._run(prog, "DDP step", run_params, buffers, hstate, self.acc,
                        opt_state, batch, extra, active)
        value, aux, grads, new_buffers, hstate, acc, new_params, new_opt, n_active = out
        if donating:
            self.donation.made(new_params, new_opt, hstate, replace=True)
        self.hooks.state = hstate
        self.acc = acc
        # the leaves with a gradient in this program: derived once per trace from what it
        # recorded (the unused ones; a retrace records a new tuple), not at every step
        unused = record.get("unused", ())
        if record.get("used_of") is not unused:
            record["used_of"] = unused
            record["used"] = frozenset(range(len(self.leaves))) - frozenset(unused)
        used = record["used"]
        before = self.acc_had_grad if has_acc else frozenset()
        self.acc_had_grad = frozenset() if sync else before | used
        if sync and update is not None:
            self.skipped.note(used | had_grad)
        self.last_synced = sync
        self.checks.seen(new_params if new_params is not None else module_params)
        self.steps += 1
        if js is not None:
            js.after_step(int(n_active), g.num_replicas)
        if not sync:
            value = jax.numpy.mean(_placement.local_rows(value))
        if grads is not None and params is not module_params:
            grads = _placement.placed_like(grads, module_params)  # torch: p.grad beside p
        return dict(loss=value, aux=_placement.local_rows(aux), grads=grads,
                    buffers=self.buffers_out(new_buffers), params=new_params,
                    opt_state=new_opt)

    def forward(self, key: Any, apply: Callable, params: Any, module_buffers: Any,
                inputs: Any) -> tuple[Any, Any]:
        """Run the forward program; returns (this process's outputs, module buffers)."""
        g = self.group
        _check_concrete("the DDP forward ddp(x)", params, inputs)
        module_params, params = params, _placement.replicated(params, g)
        # (a forward communicates only when it broadcasts buffers; else one process may
        # make it alone, e.g. an evaluation on rank 0)
        collective = self.sync_buffers and bool(jax.tree.leaves(module_buffers))
        self.checks.replicas(module_params, params, collective=collective)
        self.checks.seen(module_params, collective=collective)
        inputs = _placement.shard_batch(inputs, g, what="input")
        buffers = self.buffers_in(module_buffers)
        pkey = ("fwd", key, self.sync_buffers)
        prog = self._programs.get(pkey)
        if prog is None:
            prog = _program.forward_program(self._config(), apply,
                                            sync_buffers=self.sync_buffers)
            self._programs[pkey] = prog
        out, new_buffers = self._run(prog, "DDP forward", params, buffers, inputs)
        self.last_synced = self.require_backward_grad_sync
        out = _placement.local_rows(out)
        if len(g.local_devices) == 1:  # torch's DDP: this rank's scalars stay scalars
            leaves, tdef = jax.tree.flatten(out)
            out = jax.tree.unflatten(tdef, [x[0] if s else x for x, s in zip(
                leaves, prog.scalars, strict=True)])
        return out, self.buffers_out(new_buffers)

    def _run(self, prog: Callable, what: str, *args: Any) -> Any:
        """Run ``prog(*args)`` and wait for it (:meth:`_wait`); across processes a runtime
        failure raised when the program is launched names the dead peer too; a comm
        hook's result found to differ across replicas raises ReplicaDivergenceError."""
        label = f"{what} #{self.steps + 1}"
        seq = None
        if self.group.size() > 1:  # numbered before launch: on CPU a launch can block
            from jdist.collectives.runtime import enter_step

            seq = enter_step(self.group, label)
        try:
            out = prog(*args)
        except Exception as exc:
            raise_hook_failure(exc)
            if self.group.size() == 1:
                raise
            from jdist.ddp._wait import runtime_failure

            err = runtime_failure(self.group, label, exc, seq)
            if err is exc:
                raise
            raise err from exc
        try:
            self._wait(out, label, seq)
        except Exception as exc:
            raise_hook_failure(exc)
            raise
        return out

    def _wait(self, out: Any, what: str, seq: int | None) -> None:
        """Wait for a program's outputs; across processes name dead peers and time out.

        With one process every participant of the step's collectives is one of its own
        devices, launched by the same call: no peer can be missing, so no watchdog is
        needed (the waiter thread of :func:`~jdist.ddp._wait.wait_ready` costs a thread
        hand-off per step, noticeable for a small model on a busy CPU). There it waits only
        on XLA:CPU, whose in-process collectives can deadlock when many programs are in
        flight, and blocks on one output that has a shard on every device (the outputs
        of one execution are ready together on each device; blocking on every leaf costs
        more host time). On GPU and TPU the step returns at once, keeping JAX's
        asynchronous dispatch (the host queues the next step while the device runs this
        one, as a torch training loop does); reading the loss waits for it.
        """
        if self.group.size() == 1:
            if self._platform == "cpu":
                _block_on_one(out, self.group.num_replicas)
            return
        from jdist.collectives.runtime import group_state
        from jdist.ddp._wait import wait_ready

        watchdog = (group_state.runtime or {}).get("watchdog")
        wait_ready(out, self.group, what, watchdog=watchdog, seq=seq)

    def remember(self, step: Callable, batch: Any, args: tuple) -> None:
        """At the start of every DDP step: inside a join context, notify it and keep the
        step, which a process out of inputs replays (:mod:`jdist.ddp._join`)."""
        if self.join_state is not None:  # notifies the join context (jdist.ddp._join)
            self.join_state.before_step(step, batch, args)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate local gradients with no collective until the context exits."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old
