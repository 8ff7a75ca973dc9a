"""``jdist.rpc.RemoteModule``: an NNX module living on another worker.

torch's ``RemoteModule(remote_device, module_cls, args=None, kwargs=None)``: the module
is built on ``remote_device`` (``"worker"``, ``"worker/cpu"``, ``"rank:1/cuda:0"``, a rank
or a WorkerInfo; the device part names one of the owner's local JAX devices, ``"cpu"``
when left out, as torch) and called by RPC. Inside a distributed
autograd pass ``forward`` is differentiable: the module's parameters get their
gradients in the context on their owner (see :mod:`jdist.rpc.dist_autograd`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from flax import nnx

from jdist.rpc._buckets import padded_call
from jdist.rpc._futures import Future
from jdist.rpc._protocol import WorkerInfo
from jdist.rpc._remote_device import local_device, parse_remote_device
from jdist.rpc._rref import RRef
from jdist.rpc._serialize import register_rpc_reducer
from jdist.rpc.autograd import _context as C
from jdist.rpc.autograd._params import param_variables

__all__ = ["PICKLED_ATTRIBUTES", "UNSUPPORTED_METHODS", "RemoteModule"]


def _construct(module_cls: Any, args: tuple, kwargs: dict, device: str = "cpu") -> Any:
    """Owner side: build the module on the local JAX device ``device`` names."""
    dev = local_device(device)
    with jax.default_device(dev):
        module = module_cls(*args, **kwargs)
    if not isinstance(module, nnx.Module):
        raise ValueError(f"Expect `module_cls(*args, **kwargs)` returns an instance of <class "
                         f"nn.Module>, but it returns an instance of {type(module)}: "
                         f"RemoteModule needs a flax.nnx.Module class, got {module_cls!r}")
    if dev != jax.local_devices()[0]:  # not the default device: commit the state there
        nnx.update(module, jax.device_put(nnx.state(module), dev))
    return module


@functools.partial(jax.jit, static_argnums=0)
def _pure_call(gdef: Any, params: Any, rest: Any, args: tuple, kwargs: dict) -> tuple:
    """The module's call as a pure program: its output and its non-parameter state
    after (RNG counters, batch statistics)."""
    module = nnx.merge(gdef, params, rest)
    out = module(*args, **kwargs)
    return out, nnx.split(module, nnx.Param, ...)[2]


def owned_call(module: Any, args: tuple, kwargs: dict) -> Any:
    """``module(*args, **kwargs)`` as one compiled program, safe from several threads.

    RPC runs calls on a pool of threads, and ``nnx.jit`` on one module from two threads
    at once corrupts it (flax 0.12: "object has no attribute ..."): so the module is
    split (a read), the program runs on the split state, and only the non-parameter
    state is written back (a parameter update made meanwhile, by a
    ``DistributedOptimizer``, is kept, as in torch)."""
    gdef, params, rest = nnx.split(module, nnx.Param, ...)
    out, rest_after = _pure_call(gdef, params, rest, args, kwargs)
    if jax.tree_util.tree_leaves(rest_after):
        nnx.update(module, rest_after)
    return out


def _jittable(tree: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(tree)
    return all(isinstance(x, (np.ndarray, jax.Array, int, float, bool, np.generic))
               for x in leaves)


def _forward(module_rref: RRef, args: tuple, kwargs: dict) -> Any:
    """Owner side of ``forward``: one compiled program when the inputs are arrays
    (compiled once per shape, or per shape bucket for a module with ``bucket_call``,
    see ``_buckets.py``; ``autograd/_compiled.py`` also compiles this call with its VJP
    under distributed autograd), otherwise a plain call."""
    module = module_rref.local_value()
    if _jittable((args, kwargs)):
        padded = None if kwargs or C.tracing() is not None else padded_call(module, args)
        if padded is not None:  # a few shape buckets, cut back exactly
            out = owned_call(module, padded.args, {})
            return jax.tree_util.tree_map(jax.device_put, padded.cut_output(out))
        return owned_call(module, args, kwargs)
    return module(*args, **kwargs)


_forward._jdist_compiled_forward = True  # under dist autograd: autograd/_compiled.py


def _param_rrefs(module_rref: RRef, recurse: bool = True) -> list[RRef]:
    module = module_rref.local_value()
    if recurse:
        variables = param_variables(module)
    else:  # the module's own Params, not its submodules'
        variables = [v for v in vars(module).values() if isinstance(v, nnx.Param)]
    return [RRef.owned_by(module_rref._agent, v) for v in variables]


def _set_mode(module_rref: RRef, training: bool) -> None:
    module = module_rref.local_value()
    module.train() if training else module.eval()


# what travels when a RemoteModule is sent by RPC (torch's names); anything else set on
# an instance stays behind
PICKLED_ATTRIBUTES = ("on", "device", "is_device_map_set", "is_scriptable",
                      "generated_methods", "module_rref")

# torch nn.Module methods that make no sense on a module that lives elsewhere (torch
# raises for the same ones)
UNSUPPORTED_METHODS = (
    "register_buffer", "register_parameter", "add_module", "apply", "cuda", "ipu", "xpu",
    "cpu", "type", "float", "double", "half", "bfloat16", "to", "register_backward_hook",
    "register_forward_pre_hook", "register_forward_hook", "state_dict", "load_state_dict",
    "named_parameters", "buffers", "named_buffers", "children", "named_children",
    "modules", "named_modules", "requires_grad_", "zero_grad", "share_memory",
    "extra_repr")


def _unsupported(name: str, hint: str = "") -> Any:
    def method(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"Method ``{name}`` not supported for RemoteModule{hint}")

    method.__name__ = name
    method.__doc__ = f"Raises ``ValueError``: torch's ``{name}`` has no RemoteModule meaning."
    return method


class RemoteModule:
    """An NNX module built and kept on another worker, called by RPC.

    Args:
      remote_device: where the module lives: ``"worker"`` (device ``"cpu"``, as torch),
        ``"worker/cpu"``, ``"worker/cuda:0"``, ``"rank:0/cpu"``, a rank or a
        WorkerInfo. The owner builds the module on that local JAX device (``cuda:N``
        is its N-th GPU) and raises ``RuntimeError`` if it has none.
      module_cls: an ``nnx.Module`` class (module level, so it pickles by reference).
      args, kwargs: its constructor's arguments (sent by pickle; pass seeds rather than
        ``nnx.Rngs`` objects if those do not pickle).
      agent: the RPC agent (default: this process's).

    ``forward`` / ``__call__`` run ``module(*args, **kwargs)`` on the owner;
    ``forward_async`` returns a Future; ``remote_parameters()`` gives one RRef per
    ``nnx.Param`` (for :class:`~jdist.rpc.DistributedOptimizer`);
    ``get_module_rref()`` (also ``module_rref``) the RRef to the module itself;
    ``train()`` / ``eval()`` call NNX's ``train()`` / ``eval()`` on the owner. torch's
    ``nn.Module`` methods that need the module here (``parameters``, ``state_dict``,
    ``to``, hooks, ...) raise ``ValueError``. Sent by RPC, only
    :data:`PICKLED_ATTRIBUTES` travel; plain ``pickle`` refuses it (``RuntimeError``).
    """

    def __init__(self, remote_device: Any, module_cls: Any, args: tuple | None = None,
                 kwargs: dict | None = None, *, agent: Any = None):
        if agent is None:
            from jdist.rpc._state import current_agent

            agent = current_agent()
        if not callable(module_cls):
            raise TypeError(f"module_cls must be an nnx.Module class, got {module_cls!r}")
        worker, device = parse_remote_device(remote_device)
        owner = agent.worker_info(worker)
        rref = agent.remote(owner, _construct,
                            (module_cls, tuple(args or ()), dict(kwargs or {}), device))
        self._set(owner.name, device, rref)
        created = rref._created
        if created is not None:  # raise a constructor error here, not at the first call
            created.wait()

    def _set(self, on: Any, device: str, module_rref: RRef) -> None:
        self.on = on
        self.device = device
        self.is_device_map_set = False  # jdist's RPC moves arrays through the host
        self.is_scriptable = False  # no TorchScript
        self.generated_methods = ("forward", "forward_async")
        self.module_rref = module_rref

    @classmethod
    def init_from_module_rref(cls, remote_device: Any, module_rref: RRef,
                              _module_interface_cls: Any = None) -> RemoteModule:
        """A RemoteModule for an existing module RRef (torch's alternate constructor).

        Calls go to the RRef's owner (as torch); ``remote_device`` is recorded as ``on``
        and ``device``.
        """
        del _module_interface_cls
        if not isinstance(module_rref, RRef):
            raise TypeError(f"module_rref must be an RRef to an nnx.Module, got "
                            f"{type(module_rref).__name__}")
        worker, device = parse_remote_device(remote_device)
        self = cls.__new__(cls)
        self._set(module_rref._agent.worker_info(worker).name, device, module_rref)
        return self

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        register_rpc_reducer(cls, _rpc_reduce)

    def __reduce__(self):
        raise RuntimeError("Cannot pickle RemoteModule in python pickler. RemoteModule can "
                           "only be pickled when using RPC (as an argument or result of "
                           "rpc_sync/rpc_async/remote)")

    def __repr__(self) -> str:
        return f"RemoteModule(on {self.on}/{self.device}, {self.module_rref!r})"

    @property
    def _agent(self) -> Any:
        return self.module_rref._agent

    @property
    def owner(self) -> WorkerInfo:
        """The worker holding the module."""
        return self.module_rref.owner()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """``module(*args, **kwargs)`` on the owner (differentiable in a loss function)."""
        return self.forward_async(*args, **kwargs).wait()

    __call__ = forward

    def forward_async(self, *args: Any, **kwargs: Any) -> Future:
        """Like :meth:`forward`; a Future of the result."""
        return self._agent.rpc_async(self.owner, _forward, (self.module_rref, args, kwargs))

    def remote_parameters(self, recurse: bool = True) -> list[RRef]:
        """One RRef per ``nnx.Param`` of the module (owned by the module's worker);
        ``recurse=False``: only the module's own, not its submodules'."""
        return self._agent.rpc_async(self.owner, _param_rrefs,
                                     (self.module_rref, recurse)).wait()

    def get_module_rref(self) -> RRef:
        """The RRef to the module on its owner."""
        return self.module_rref

    def train(self, mode: bool = True) -> RemoteModule:
        """NNX ``train()`` (``mode=False``: ``eval()``) on the owner's module."""
        self._agent.rpc_async(self.owner, _set_mode, (self.module_rref, bool(mode))).wait()
        return self

    def eval(self) -> RemoteModule:
        """NNX ``eval()`` on the owner's module."""
        return self.train(False)

    parameters = _unsupported("parameters", ". Please use ``remote_parameters`` instead.")
    for _name in UNSUPPORTED_METHODS:
        locals()[_name] = _unsupported(_name)
    del _name


def _rpc_reduce(rm: RemoteModule) -> tuple:
    return _rebuild, tuple(getattr(rm, a) for a in PICKLED_ATTRIBUTES)


def _rebuild(on: Any, device: str, is_device_map_set: bool, is_scriptable: bool,
             generated_methods: tuple, module_rref: RRef) -> RemoteModule:
    self = RemoteModule.__new__(RemoteModule)
    self._set(on, device, module_rref)
    self.is_device_map_set, self.is_scriptable = is_device_map_set, is_scriptable
    self.generated_methods = generated_methods
    return self


register_rpc_reducer(RemoteModule, _rpc_reduce)
