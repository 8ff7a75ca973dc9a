"""``jdist.rpc.RemoteModule``: an NNX module living on another worker.

torch's ``RemoteModule(remote_device, module_cls, args=None, kwargs=None)``: the module
is built on ``remote_device`` (``"worker"``, ``"worker/cpu"``, ``"rank:1/cpu"``, a rank
or a WorkerInfo; the device part is accepted for torch compatibility, the module
uses that worker's default JAX device) and called by RPC. Inside a distributed
autograd pass ``forward`` is differentiable: the module's parameters get their
gradients in the context on their owner (see :mod:`jdist.rpc.dist_autograd`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from jdist.rpc._futures import Future
from jdist.rpc._protocol import WorkerInfo
from jdist.rpc._rref import RRef
from jdist.rpc.autograd import _context as C
from jdist.rpc.autograd._compiled import pad_bags
from jdist.rpc.autograd._params import param_variables

__all__ = ["RemoteModule"]


def _parse_device(remote_device: Any) -> Any:
    if isinstance(remote_device, (WorkerInfo, int)) and not isinstance(remote_device, bool):
        return remote_device
    if not isinstance(remote_device, str) or not remote_device:
        raise TypeError(f"remote_device must be 'worker', 'worker/device', 'rank:R/device', a "
                        f"rank or a WorkerInfo, got {remote_device!r}")
    worker = remote_device.split("/", 1)[0]
    if worker.startswith("rank:"):
        try:
            return int(worker[len("rank:"):])
        except ValueError:
            raise ValueError(f"bad rank in remote_device {remote_device!r}; expected "
                             "'rank:1/cpu'") from None
    return worker


def _construct(module_cls: Any, args: tuple, kwargs: dict) -> Any:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nnx.Module):
        raise TypeError(f"RemoteModule needs a flax.nnx.Module class, but {module_cls!r} "
                        f"built a {type(module).__name__}")
    return module


def _call(module: Any, args: tuple, kwargs: dict) -> Any:
    return module(*args, **kwargs)


_jit_call = nnx.jit(_call)


def _jittable(tree: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(tree)
    return all(isinstance(x, (np.ndarray, jax.Array, int, float, bool, np.generic))
               for x in leaves)


def _forward(module_rref: RRef, args: tuple, kwargs: dict) -> Any:
    """Owner side of ``forward``: one ``nnx.jit`` program when the inputs are arrays
    (compiled once per shape; an EmbeddingBag's bags padded to a few shape buckets, see
    ``autograd/_compiled.py``, which also compiles this call with its VJP under
    distributed autograd), otherwise a plain call."""
    module = module_rref.local_value()
    if _jittable((args, kwargs)):
        padded = None if kwargs or C.tracing() is not None else pad_bags(module, args)
        if padded is not None:  # EmbeddingBag: a few shape buckets, cut back exactly
            pargs, rows, _ = padded
            out = _jit_call(module, pargs, {})
            return jax.device_put(np.asarray(out)[:rows])
        return _jit_call(module, args, kwargs)
    return module(*args, **kwargs)


_forward._jdist_compiled_forward = True  # under dist autograd: autograd/_compiled.py


def _param_rrefs(module_rref: RRef) -> list[RRef]:
    return [RRef.owned_by(module_rref._agent, v)
            for v in param_variables(module_rref.local_value())]


class RemoteModule:
    """An NNX module built and kept on another worker, called by RPC.

    Args:
      remote_device: where the module lives (``"ps"``, ``"ps/cpu"``, ``"rank:0/cpu"``,
        a rank or a WorkerInfo).
      module_cls: an ``nnx.Module`` class (module level, so it pickles by reference).
      args, kwargs: its constructor's arguments (sent by pickle; pass seeds rather than
        ``nnx.Rngs`` objects if those do not pickle).
      agent: the RPC agent (default: this process's).

    ``forward`` / ``__call__`` run ``module(*args, **kwargs)`` on the owner;
    ``forward_async`` returns a Future; ``remote_parameters()`` gives one RRef per
    ``nnx.Param`` (for :class:`~jdist.rpc.DistributedOptimizer`);
    ``get_module_rref()`` the RRef to the module itself.
    """

    def __init__(self, remote_device: Any, module_cls: Any, args: tuple | None = None,
                 kwargs: dict | None = None, *, agent: Any = None):
        if agent is None:
            from jdist.rpc._state import current_agent

            agent = current_agent()
        if not callable(module_cls):
            raise TypeError(f"module_cls must be an nnx.Module class, got {module_cls!r}")
        self._agent = agent
        self._owner = agent.worker_info(_parse_device(remote_device))
        self._module_rref = agent.remote(self._owner, _construct,
                                         (module_cls, tuple(args or ()), dict(kwargs or {})))
        created = self._module_rref._created
        if created is not None:  # raise a constructor error here, not at the first call
            created.wait()

    @classmethod
    def init_from_module_rref(cls, remote_device: Any, module_rref: RRef,
                              _module_interface_cls: Any = None) -> RemoteModule:
        """A RemoteModule for an existing module RRef (torch's alternate constructor)."""
        del _module_interface_cls
        self = cls.__new__(cls)
        self._agent = module_rref._agent
        self._owner = self._agent.worker_info(_parse_device(remote_device))
        if module_rref.owner() != self._owner:
            raise ValueError(f"module_rref is owned by {module_rref.owner()}, not by "
                             f"{self._owner} given as remote_device")
        self._module_rref = module_rref
        return self

    def __reduce__(self):
        # sent by RPC: the module RRef travels through the fork protocol
        return _rebuild, (self._owner.id, self._module_rref)

    def __repr__(self) -> str:
        return f"RemoteModule(on {self._owner}, {self._module_rref!r})"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``module(*args, **kwargs)`` on the owner (differentiable in a loss function)."""
        return self.forward_async(*args, **kwargs).wait()

    __call__ = forward

    def forward_async(self, *args: Any, **kwargs: Any) -> Future:
        """Like :meth:`forward`; a Future of the result."""
        return self._agent.rpc_async(self._owner, _forward,
                                     (self._module_rref, args, kwargs))

    def remote_parameters(self, recurse: bool = True) -> list[RRef]:
        """One RRef per ``nnx.Param`` of the module (owned by the module's worker)."""
        del recurse
        return self._agent.rpc_async(self._owner, _param_rrefs, (self._module_rref,)).wait()

    def get_module_rref(self) -> RRef:
        """The RRef to the module on its owner."""
        return self._module_rref

    @property
    def owner(self) -> WorkerInfo:
        """The worker holding the module."""
        return self._owner



def _rebuild(owner: int, module_rref: RRef) -> RemoteModule:
    return RemoteModule.init_from_module_rref(owner, module_rref)
