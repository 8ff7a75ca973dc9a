"""``PipelineStage``: one stage of a pipeline, a Flax NNX module run as compiled programs.

Per micro-batch the stage runs a compiled forward that also returns the backward's
residuals (``jax.vjp`` inside ``jit``: its pullback is a pytree of arrays), and later a
compiled backward on them: the full backward (``B``), or its input half (``I``) and its
weight half (``W``) as two programs, each computing only its own gradients (XLA drops
what a program does not return). Weight gradients accumulate over the micro-batches of
a step and are divided by their count when the schedule scales them (torch's
``scale_grads``); they are then :attr:`PipelineStage.grads`, an ``nnx.State`` of the
module's parameters, ready for ``nnx.Optimizer.update``.

The stage reads its module's parameters at the start of each step, so an optimizer
update between steps is seen. A module with variables other than ``nnx.Param`` (batch
statistics, RNG streams) is refused: their updates inside a stage would be lost.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

__all__ = ["PipelineStage"]


def _as_tuple(x: Any) -> tuple:
    return x if isinstance(x, tuple) else (x,)


class _Programs:
    """The compiled forward/backward programs of one module structure.

    Parameters travel as the flat list of their leaves (a list flattens in
    microseconds, an ``nnx.State`` in tens of them, on every call). A backward that is
    not the step's first adds its weight gradients into the running sum in the same
    program, consuming (donating) the sum: one program and no extra pass over the
    gradients per micro-batch."""

    def __init__(self, graphdef, treedef, loss_fn) -> None:
        def run(leaves, xs):
            return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))(*xs)

        def with_loss(leaves, xs, target):
            out = run(leaves, xs)
            return loss_fn(out, target), out

        def add(acc, gp):
            return [a + g for a, g in zip(acc, gp, strict=True)]

        def backward_add(vjp, ct, acc):
            gp, gxs = vjp(ct)
            return add(acc, gp), gxs

        self.forward = jax.jit(lambda p, xs: jax.vjp(run, p, xs))
        self.forward_loss = jax.jit(
            lambda p, xs, y: jax.vjp(lambda p, xs: with_loss(p, xs, y), p, xs, has_aux=True))
        self.infer = jax.jit(run)
        self.backward = jax.jit(lambda vjp, ct: vjp(ct))
        self.backward_add = jax.jit(backward_add, donate_argnums=2)
        self.backward_input = jax.jit(lambda vjp, ct: vjp(ct)[1])
        self.backward_weight = jax.jit(lambda vjp, ct: vjp(ct)[0])
        self.backward_weight_add = jax.jit(lambda vjp, ct, acc: add(acc, vjp(ct)[0]),
                                           donate_argnums=2)
        self.scale = jax.jit(lambda a, n: [v / n for v in a], donate_argnums=0)


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages`` running ``submodule`` (an ``nnx.Module``).

    Args:
      submodule: the stage's layers; its ``__call__`` takes the previous stage's output
        (unpacked when it is a tuple) or, for stage 0, the step's arguments.
      stage_index, num_stages: this stage's place in the pipeline.
      device: where the stage's parameters and activations live (default: JAX's default
        device); stages of one process may sit on different local devices.

    Raises:
      ValueError: bad indices, or a module with non-parameter variables.
    """

    def __init__(self, submodule: nnx.Module, stage_index: int, num_stages: int,
                 device: jax.Device | None = None) -> None:
        if not isinstance(submodule, nnx.Module):
            raise ValueError(f"PipelineStage needs a Flax NNX module, got "
                             f"{type(submodule).__name__}; wrap Linen modules with "
                             f"nnx.bridge.ToNNX")
        for what, v in (("stage_index", stage_index), ("num_stages", num_stages)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"PipelineStage: {what} must be an int, got {v!r}")
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage: stage_index {stage_index} is not in "
                             f"[0, {num_stages}); number the stages 0..num_stages-1")
        _, _, rest = nnx.split(submodule, nnx.Param, ...)
        if jax.tree.leaves(rest):
            kinds = sorted({type(v).__name__ for _, v in nnx.to_flat_state(rest)})
            raise ValueError(f"PipelineStage {stage_index}: the module holds variables "
                             f"other than nnx.Param ({', '.join(kinds)}); a pipeline stage "
                             f"would lose their updates. Use a module whose forward only "
                             f"reads parameters")
        self.submod = submodule
        self.stage_index, self.num_stages = stage_index, num_stages
        self.device = device
        self.grads: nnx.State | None = None
        self._programs: dict[Any, _Programs] = {}
        self._params = None
        self._pending: dict[int, Any] = {}
        self._cotangent: dict[int, Any] = {}
        self._seeds: dict[int, Any] = {}
        self._acc = None

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def _put(self, tree):
        return tree if self.device is None else jax.device_put(tree, self.device)

    def begin(self, loss_fn) -> None:
        """Start a step: read the module's parameters; forget the last step's state."""
        graphdef, params = nnx.split(self.submod, nnx.Param)
        leaves, self._treedef = jax.tree.flatten(params)
        key = (graphdef, self._treedef, loss_fn)
        if key not in self._programs:
            self._programs[key] = _Programs(graphdef, self._treedef, loss_fn)
        self._run = self._programs[key]
        self._params = self._put(leaves)
        self._pending, self._cotangent, self._seeds, self._acc = {}, {}, {}, None

    def forward(self, mb: int, inputs: Any, target: Any = None, with_grad: bool = True):
        """Micro-batch ``mb``'s output (the last stage with a target: ``(output, loss)``)."""
        xs = self._put(_as_tuple(inputs))
        if not with_grad:
            return self._run.infer(self._params, xs)
        if target is not None:
            loss, vjp, out = self._run.forward_loss(self._params, xs, self._put(target))
            self._pending[mb] = vjp
            self._seeds[mb] = jax.numpy.ones_like(loss)  # d loss / d loss
            return out, loss
        out, vjp = self._run.forward(self._params, xs)
        self._pending[mb] = vjp
        return out

    def _seed(self, mb: int, grad_output: Any):
        if grad_output is not None:
            return self._put(grad_output)
        if mb not in self._seeds:
            raise RuntimeError(f"stage {self.stage_index}: backward of micro-batch {mb} "
                               f"has no gradient from stage {self.stage_index + 1} and no "
                               f"loss of its own")
        return self._seeds.pop(mb)

    def backward(self, mb: int, grad_output: Any = None) -> tuple:
        """Full backward (``B``) of ``mb``: accumulates weight gradients; returns the
        gradients of the stage's inputs (a tuple, as its inputs)."""
        vjp, ct = self._take(mb), self._seed(mb, grad_output)
        if self._acc is None:
            self._acc, gxs = self._run.backward(vjp, ct)
        else:
            self._acc, gxs = self._run.backward_add(vjp, ct, self._acc)
        return gxs

    def backward_input(self, mb: int, grad_output: Any = None) -> tuple:
        """Input half (``I``) of ``mb``'s backward; its weight half waits for :meth:`
        backward_weight`."""
        ct = self._seed(mb, grad_output)
        self._cotangent[mb] = ct
        return self._run.backward_input(self._pending[mb], ct)

    def backward_weight(self, mb: int) -> None:
        """Weight half (``W``) of ``mb``'s backward, after :meth:`backward_input`."""
        if mb not in self._cotangent:
            raise RuntimeError(f"stage {self.stage_index}: weight backward of micro-batch "
                               f"{mb} before its input backward")
        vjp, ct = self._take(mb), self._cotangent.pop(mb)
        self._acc = (self._run.backward_weight(vjp, ct) if self._acc is None
                     else self._run.backward_weight_add(vjp, ct, self._acc))

    def _take(self, mb: int):
        if mb not in self._pending:
            raise RuntimeError(f"stage {self.stage_index}: backward of micro-batch {mb} "
                               f"before its forward")
        return self._pending.pop(mb)

    def finish(self, divide_by: int) -> None:
        """End a step: :attr:`grads` is the accumulated weight gradient / ``divide_by``."""
        if self._pending or self._cotangent:
            left = sorted(set(self._pending) | set(self._cotangent))
            raise RuntimeError(f"stage {self.stage_index}: micro-batches {left} have no "
                               f"(complete) backward; the schedule is incomplete")
        if self._acc is not None and divide_by != 1:
            self._acc = self._run.scale(self._acc, float(divide_by))
        self.grads = None if self._acc is None else jax.tree.unflatten(self._treedef,
                                                                       self._acc)
        self._acc = None  # (the user's grads are never donated)
