"""``jdist.rpc.DistributedOptimizer``: one optax optimizer per parameter owner.

torch's ``DistributedOptimizer(optimizer_class, params_rref, *args, **kwargs)`` groups
the parameter RRefs by owner and creates one optimizer on each owner;
``step(context_id)`` runs every owner's step concurrently with the gradients that
distributed autograd accumulated there in that context, and waits for all of them.
Here each owner keeps one optax state over its parameters (``nnx.Variable`` s, or
every ``nnx.Param`` of a module, behind the RRefs) and updates them in place.

``tx`` is either an optax factory (``optax.sgd``, ``optax.adam``: torch's optimizer
class) called on each owner with ``*args, **kwargs``, or a ready
``optax.GradientTransformation`` (sent to remote owners by pickle, so it has to be
picklable: most optax transformations are closures and are not; pass the factory).

Steps on one worker are serialized by one lock (as torch); steps of different clients are
not ordered. A parameter with no gradient in the context keeps its value, as torch skips
it; its optimizer state still sees a zero gradient (optax needs a full tree: momentum
and Adam's moments decay, and the step count is shared, where torch's per-parameter
state waits); an owner with no gradient at all in the context skips its step, as torch.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jdist._donation import Donation
from jdist.errors import DistAutogradError, RRefError
from jdist.rpc._futures import Future
from jdist.rpc._rref import RRef
from jdist.rpc.autograd import _context as C
from jdist.rpc.autograd._params import param_variables, read_variable, write_variable

__all__ = ["DistributedOptimizer", "LocalOptimizer"]


def _build_tx(tx: Any, args: tuple, kwargs: dict) -> optax.GradientTransformation:
    if isinstance(tx, optax.GradientTransformation):
        if args or kwargs:
            raise TypeError(f"tx is already an optax transformation; extra arguments "
                            f"{args!r} {kwargs!r} make sense only with a factory such as "
                            "optax.sgd")
        return tx
    try:
        out = tx(*args, **kwargs)
    except TypeError as e:
        if "lr" in kwargs and "learning_rate" not in kwargs:
            raise TypeError(f"{e}: optax factories take learning_rate=, not torch's lr=; "
                            f"write DistributedOptimizer({getattr(tx, '__name__', tx)}, "
                            f"params, learning_rate={kwargs['lr']!r})") from e
        raise
    if not isinstance(out, optax.GradientTransformation):
        raise TypeError(f"tx(*args, **kwargs) must return an optax.GradientTransformation, "
                        f"got {type(out).__name__} from {tx!r}")
    return out


_STEP_LOCK = threading.Lock()  # torch's _LocalOptimizer.global_lock


class LocalOptimizer:
    """The optimizer living on one owner (torch's ``_LocalOptimizer``).

    Steps of all local optimizers of a worker are serialized by one lock (as torch):
    two clients' optimizers updating the same parameter would otherwise lose one
    read-modify-write.
    """

    def __init__(self, tx: Any, args: tuple, kwargs: dict, rrefs: Sequence[RRef]):
        if not rrefs:
            raise ValueError("LocalOptimizer needs at least one parameter RRef")
        self.agent = rrefs[0]._agent
        self.tx = _build_tx(tx, args, kwargs)
        self.variables: list = []
        for r in rrefs:
            if not r.is_owner():
                raise RRefError(f"{r!r} is not owned by {self.agent.info}; the "
                                "DistributedOptimizer sends each RRef to its owner")
            self.variables.extend(param_variables(r.local_value()))
        self.opt_state = self.tx.init(self._values())
        # the state is this optimizer's own and replaced by each step: donated (the
        # parameters are not: other RPC threads may be running the module on them)
        self._donation = Donation()
        self._donation.made(self.opt_state)
        self._update = jax.jit(self._pure_update, donate_argnums=(1,))

    def _values(self) -> list:
        return [read_variable(v) for v in self.variables]

    def _pure_update(self, grads, opt_state, params):
        # a parameter without a gradient in the context (None: a static leaf of the
        # signature) goes into optax's update as zeros (it needs a full tree) and keeps
        # its value, as torch's optimizers skip it (weight decay, momentum and Adam's
        # moments would otherwise move it)
        full = [jnp.zeros_like(p) if g is None else jnp.asarray(g, p.dtype)
                for g, p in zip(grads, params, strict=True)]
        updates, opt_state = self.tx.update(full, opt_state, params)
        new = optax.apply_updates(params, updates)
        return [p if g is None else n for g, p, n in zip(grads, params, new, strict=True)], \
            opt_state

    def step(self, context_id: int) -> int:
        """Apply this owner's gradients of context ``context_id``; how many it had."""
        ctx = C.registry(self.agent).get(context_id)
        with _STEP_LOCK:  # every optimizer of this worker: they may share parameters
            params = self._values()
            with ctx.lock:
                found = [ctx.grads.get(id(v)) for v in self.variables]
            if all(g is None for g in found):
                return 0
            grads = [None if g is None else g[1] for g in found]
            # an optimizer state holding the parameters themselves (lookahead) gets a
            # copy of them: the parameters must survive the step (jdist/_donation.py)
            state = self._donation.own(self.opt_state, self.opt_state,
                                       {id(p) for p in params})
            new, self.opt_state = self._update(grads, state, params)
            self._donation.made(self.opt_state, replace=True)
            for var, value in zip(self.variables, new, strict=True):
                write_variable(var, value)
        return sum(g is not None for g in found)


@C._internal
def _local_step(opt_rref: RRef, context_id: int) -> int:
    return opt_rref.local_value().step(context_id)


class DistributedOptimizer:
    """torch's ``DistributedOptimizer`` over parameters held in RRefs.

    This is ``torch.distributed.optim.DistributedOptimizer`` (one optimizer per owner
    of the parameters, stepped over RPC). Horovod's ``DistributedOptimizer``, which
    all-reduces gradients inside a data-parallel step, is
    :func:`jdist.optim.AllReduceOptimizer` (alias ``jdist.optim.DistributedOptimizer``).

    Args:
      tx: an optax factory (``optax.sgd``; called on each owner with ``*args,
        **kwargs``) or a picklable ``optax.GradientTransformation``.
      params_rref: RRefs to the parameters: ``nnx.Variable`` s (``nnx.Param``) or NNX
        modules (all their ``nnx.Param`` s), local (``RRef(module)``) or remote
        (``RemoteModule.remote_parameters()``).
      *args, **kwargs: the factory's arguments (``learning_rate=0.05``).

    Example::

        opt = DistributedOptimizer(optax.sgd, remote_params + [RRef(local_layer)],
                                   learning_rate=0.05)
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, loss_fn, ...)
            opt.step(cid)
    """

    def __init__(self, tx: Any, params_rref: Sequence[RRef], *args: Any, **kwargs: Any):
        params_rref = list(params_rref)
        if not params_rref:
            raise ValueError("DistributedOptimizer needs at least one parameter RRef, got an "
                             "empty list")
        bad = [r for r in params_rref if not isinstance(r, RRef)]
        if bad:
            raise TypeError(f"params_rref must hold jdist.rpc.RRef objects, got "
                            f"{type(bad[0]).__name__}; wrap local parameters in RRef(...)")
        if not (callable(tx) or isinstance(tx, optax.GradientTransformation)):
            raise TypeError(f"tx must be an optax factory (optax.sgd) or an "
                            f"optax.GradientTransformation, got {tx!r}")
        if not isinstance(tx, optax.GradientTransformation):
            _build_tx(tx, args, kwargs)  # a bad argument (torch's lr=) fails here, named
        self._agent = params_rref[0]._agent
        by_owner: dict[int, list[RRef]] = {}
        for r in params_rref:
            by_owner.setdefault(r.owner().id, []).append(r)
        remote_owners = [w for w in by_owner if w != self._agent.info.id]
        if remote_owners:
            _check_picklable(tx, args, kwargs)
        me = self._agent.info.id
        futs = {w: self._agent.rpc_async(w, _owner_create, (tx, args, kwargs, rrefs))
                for w, rrefs in by_owner.items() if w != me}
        self._optimizers: dict[int, RRef] = {}
        errors = []
        if me in by_owner:  # built here: tx need not pickle
            self._optimizers[me] = RRef.owned_by(
                self._agent, LocalOptimizer(tx, args, kwargs, by_owner[me]))
        for w, f in futs.items():
            try:
                self._optimizers[w] = f.wait()
            except Exception as e:  # noqa: BLE001 - all owners reported below
                errors.append((w, e))
        _raise_first(errors, self._agent, "creating the optimizer")

    @property
    def owners(self) -> list[Any]:
        """The WorkerInfo of every owner holding an optimizer."""
        return [self._agent.worker_info(w) for w in sorted(self._optimizers)]

    def step(self, context_id: int, timeout: float = -1) -> None:
        """Update every owner's parameters with its gradients of ``context_id``.

        The owners' steps run concurrently; this waits for all of them.

        Raises:
          the first owner's error (with a note naming every failed owner), after all
          owners are done: e.g. :class:`~jdist.errors.DistAutogradError` for a released
          context, :class:`~jdist.errors.WorkerUnavailableError` for a dead owner.
        """
        if not isinstance(context_id, int) or isinstance(context_id, bool):
            raise TypeError(f"context_id must be the int from dist_autograd.context(), got "
                            f"{context_id!r}")
        futs: dict[int, Future] = {}
        errors = []
        me = self._agent.info.id
        for w, opt in self._optimizers.items():
            if w == me:
                continue
            try:
                futs[w] = self._agent.rpc_async(w, _local_step, (opt, context_id), None,
                                                timeout)
            except Exception as e:  # noqa: BLE001
                errors.append((w, e))
        if me in self._optimizers:  # this worker's own step: here, while the others run
            try:  # (an RPC to itself would cross a socket and two thread hand-offs)
                _local_step(self._optimizers[me], context_id)
            except Exception as e:  # noqa: BLE001
                errors.append((me, e))
        for w, f in futs.items():
            try:
                f.wait()
            except Exception as e:  # noqa: BLE001
                errors.append((w, e))
        _raise_first(errors, self._agent, f"step({context_id})")


@C._internal
def _owner_create(tx: Any, args: tuple, kwargs: dict, rrefs: list[RRef]) -> RRef:
    opt = LocalOptimizer(tx, args, kwargs, rrefs)
    return RRef.owned_by(rrefs[0]._agent, opt)


def _check_picklable(tx: Any, args: tuple, kwargs: dict) -> None:
    try:
        pickle.dumps((tx, args, kwargs), protocol=5)
    except Exception as e:
        hint = ""
        if isinstance(tx, optax.GradientTransformation):
            hint = (" optax transformations are closures; pass the factory and its "
                    "arguments instead, e.g. DistributedOptimizer(optax.sgd, params, "
                    "learning_rate=0.05)")
        raise TypeError(f"DistributedOptimizer must send tx {tx!r} to remote owners, but it "
                        f"cannot be pickled: {e}.{hint}") from e


def _raise_first(errors: list, agent: Any, what: str) -> None:
    if not errors:
        return
    names = ", ".join(str(agent.worker_info(w)) for w, _ in errors)
    first = errors[0][1]
    if isinstance(first, BaseException) and hasattr(first, "add_note"):
        first.add_note(f"DistributedOptimizer {what} failed on: {names}")
        raise first
    raise DistAutogradError(f"DistributedOptimizer {what} failed on: {names}: {first!r}")
