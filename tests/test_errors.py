"""Every public jdist error is an instance of the builtin class torch raises there.

``TORCH`` maps each class of ``jdist.errors`` to the builtin exception classes that
torch raises in the same situation (the situation is in the comment; torch's own
classes such as ``DistStoreError`` derive from ``RuntimeError``). A new error class
must be added to the table, so the rule cannot be skipped. Where torch can be run here
in one process, the builtin class is read from torch itself instead of written down.
"""

from __future__ import annotations

import inspect
from datetime import timedelta

import pytest

import jdist.errors as errors

TORCH: dict[str, tuple[type[BaseException], ...]] = {
    # the base of everything jdist raises on purpose
    "JdistError": (Exception,),
    # dist.get_rank() before init_process_group: ValueError("Default process group has
    # not been initialized"); rpc.rpc_sync before init_rpc: RuntimeError
    "NotInitializedError": (ValueError, RuntimeError),
    # init_process_group twice: ValueError("trying to initialize the default process
    # group twice!"); init_rpc twice: RuntimeError("RPC is already initialized")
    "AlreadyInitializedError": (ValueError, RuntimeError),
    # rendezvous disagreements (world size, duplicate rank): RuntimeError / DistError
    "RendezvousError": (RuntimeError,),
    # "Timed out initializing process group in store based barrier": DistStoreError
    "RendezvousTimeoutError": (RuntimeError, TimeoutError),
    # any store failure: DistStoreError (a RuntimeError)
    "StoreError": (RuntimeError,),
    # store.get/wait past the timeout: DistStoreError("wait timeout after ...")
    "StoreTimeoutError": (RuntimeError, TimeoutError),
    # (jdist only: a refused secret) a failing store call: DistStoreError
    "StoreAuthError": (RuntimeError,),
    # (jdist only: the size cap) a failing store call: DistStoreError
    "StoreValueTooLargeError": (RuntimeError,),
    # queue_pop(key, block=False) on an empty queue: QueueEmptyError, a DistStoreError
    "QueueEmptyError": (RuntimeError,),
    # TCPStore on a busy port: DistNetworkError("The server socket has failed to listen")
    "StoreListenError": (RuntimeError, OSError),
    # get_backend(non-member group): ValueError("Invalid process group specified");
    # broadcast(src=not a member): RuntimeError("invalid root rank")
    "GroupMismatchError": (ValueError, RuntimeError),
    # TORCH_DISTRIBUTED_DEBUG=DETAIL: RuntimeError("Detected mismatch between collectives")
    "CollectiveMismatchError": (RuntimeError,),
    # gloo collective timeout, monitored_barrier: RuntimeError / DistBackendError
    "CollectiveTimeoutError": (RuntimeError, TimeoutError),
    # all_reduce(float, BAND): RuntimeError("Cannot use ReduceOp.BAND with non-integral
    # dtype"); all_reduce(complex, MAX): ValueError("all_reduce does not support ...");
    # Python's own convention for a bad argument type: TypeError
    "UnsupportedOpError": (RuntimeError, ValueError, TypeError),
    # no torch counterpart (torch updates the tensor in place): a jdist departure that a
    # torch user's `except RuntimeError` around a collective still catches; TypeError
    # for the argument's type
    "ImmutableTargetError": (RuntimeError, TypeError),
    # a peer died inside a collective: DistBackendError("Connection closed by peer")
    "PeerFailedError": (RuntimeError,),
    # DDP's reducer when buckets and parameters disagree: RuntimeError
    "BucketLayoutError": (RuntimeError,),
    # DDP(nn.Module()): RuntimeError("DistributedDataParallel is not needed when ...")
    "NoParametersError": (RuntimeError,),
    # "Expected to have finished reduction in the prior iteration": RuntimeError
    "UnusedParametersError": (RuntimeError,),
    # "DDP expects same model across all ranks": RuntimeError
    "ModelMismatchError": (RuntimeError,),
    # (jdist only: torch's replicas drift silently) parameters differ across processes
    "ReplicaDivergenceError": (RuntimeError,),
    # Join: "Detected at least one rank that exhausted inputs": RuntimeError
    "JoinError": (RuntimeError,),
    # RPC framework failures: RuntimeError
    "RpcError": (RuntimeError,),
    # "RPC ran for more than set timeout": RuntimeError
    "RpcTimeoutError": (RuntimeError,),
    # (jdist only: a failed challenge) an RPC framework failure: RuntimeError
    "RpcAuthError": (RuntimeError,),
    # a remote exception torch cannot re-create is raised as RuntimeError
    "RemoteError": (RuntimeError,),
    # an unknown or gone destination worker: RuntimeError
    "WorkerUnavailableError": (RuntimeError,),
    # RRef misuse (local_value on a user, ...): RuntimeError
    "RRefError": (RuntimeError,),
    # rpc_sync to an unknown worker name or rank: RuntimeError("could not find
    # destination" / "Unknown destination worker")
    "UnknownWorkerError": (RuntimeError,),
    # init_rpc with a bad name: RuntimeError("Worker name must match ...")
    "WorkerNameError": (RuntimeError,),
    # dist_autograd misuse (unknown context id, nested context): RuntimeError
    "DistAutogradError": (RuntimeError,),
    # dist_autograd.backward on a non-scalar loss: RuntimeError("is not a scalar, all
    # roots need to be scalar")
    "LossTypeError": (RuntimeError,),
    # module.load_state_dict with mismatched shapes/keys: RuntimeError
    "WeightConversionError": (RuntimeError,),
    # torchft's Manager raises RuntimeError when no quorum forms or healing fails
    "FtError": (RuntimeError,),
    # torchft: a replica lost mid-step surfaces as a process group error (RuntimeError)
    "ReplicaLostError": (RuntimeError,),
    # (no torchft twin: the job ended before a late replacement joined)
    "JobFinishedError": (RuntimeError,),
}


# public error classes outside jdist.errors (the subpackage's own, by its __all__)
OTHER: dict[str, tuple[type[BaseException], ...]] = {
    # torch.multiprocessing.spawn: ProcessRaisedException / ProcessExitedException
    # (Exception); jdist's is a RuntimeError as well
    "jdist.launch.SpawnError": (Exception, RuntimeError),
    # torch.load / DCP on an unreadable or corrupt checkpoint: RuntimeError
    "jdist.checkpoint.CheckpointError": (RuntimeError,),
    "jdist.checkpoint.CheckpointCorruptError": (RuntimeError,),
    # load_state_dict with missing/unexpected keys or other shapes: RuntimeError
    "jdist.checkpoint.CheckpointMismatchError": (RuntimeError,),
    # (jdist only: torch's ZeRO runs any optimizer per parameter) a transformation ZeRO
    # cannot split: a ValueError, as optax's own bad-argument errors
    "jdist.optim.NonSeparableTransformError": (ValueError,),
}
PACKAGES = ("jdist", "jdist.collectives", "jdist.store", "jdist.launch", "jdist.rpc",
            "jdist.ddp", "jdist.dp", "jdist.optim", "jdist.sampler", "jdist.testing",
            "jdist.checkpoint")


def test_every_subpackage_error_class_is_what_torch_raises():
    import importlib

    seen = {}
    for pkg in PACKAGES:
        try:
            mod = importlib.import_module(pkg)
        except ImportError:  # a subpackage that is not there (yet)
            continue
        for name in getattr(mod, "__all__", ()):
            obj = getattr(mod, name, None)
            if (inspect.isclass(obj) and issubclass(obj, Exception)
                    and not issubclass(obj, Warning) and obj.__module__ != errors.__name__):
                seen.setdefault(obj, f"{pkg}.{name}")
    for cls, where in seen.items():
        key = next((k for k in OTHER if k.rsplit(".", 1)[1] == cls.__name__), None)
        assert key is not None, f"add {where} to OTHER (with the torch situation)"
        for base in OTHER[key]:
            assert issubclass(cls, base), f"{where} must be a {base.__name__}"


def _public_error_classes():
    out = {}
    for name in errors.__all__:
        obj = getattr(errors, name)
        assert inspect.isclass(obj) and issubclass(obj, BaseException), name
        out[name] = obj
    # nothing public is left out of __all__
    for name, obj in vars(errors).items():
        if (inspect.isclass(obj) and issubclass(obj, BaseException) and not name.startswith("_")
                and obj.__module__ == errors.__name__):
            assert name in out, f"jdist.errors.{name} is not in __all__"
    return out


def test_every_error_class_is_what_torch_raises():
    classes = _public_error_classes()
    missing = sorted(set(classes) - set(TORCH))
    assert not missing, f"add these error classes to TORCH (with the torch situation): {missing}"
    stale = sorted(set(TORCH) - set(classes))
    assert not stale, f"TORCH names classes jdist.errors no longer has: {stale}"
    for name, cls in classes.items():
        assert issubclass(cls, errors.JdistError), name
        for base in TORCH[name]:
            assert issubclass(cls, base), f"jdist.errors.{name} must be a {base.__name__}"
        cls("probe message")  # constructible with one message, as raise sites do


def _builtin_of(exc: BaseException) -> type[BaseException]:
    """The first builtin class in the MRO of a (torch) exception."""
    return next(c for c in type(exc).__mro__ if c.__module__ == "builtins")


def _torch_exc(fn) -> BaseException:
    try:
        fn()
    except Exception as e:  # torch's class, whatever it is
        return e
    raise AssertionError("torch did not raise")


def test_torch_itself_raises_those_builtins():
    """The table's cheap situations, read from torch (the oracle) and from jdist."""
    dist = pytest.importorskip("torch.distributed")
    from jdist import store as jstore
    from jdist.collectives import get_rank

    # before init: torch ValueError; jdist NotInitializedError
    t = _torch_exc(dist.get_rank)
    j = _torch_exc(get_rank)
    assert isinstance(j, errors.NotInitializedError) and isinstance(j, _builtin_of(t))
    assert "Default process group has not been initialized" in str(j)
    # a store wait past its timeout
    t = _torch_exc(lambda: dist.HashStore().wait(["k"], timedelta(seconds=0.01)))
    j = _torch_exc(lambda: jstore.HashStore().wait(["k"], timedelta(seconds=0.01)))
    assert isinstance(j, errors.StoreTimeoutError) and isinstance(j, _builtin_of(t))
    # a busy port
    held = dist.TCPStore("localhost", 0, 1, True)
    t = _torch_exc(lambda: dist.TCPStore("localhost", held.port, 1, True))
    mine = jstore.TCPStore("localhost", 0, 1, True)
    j = _torch_exc(lambda: jstore.TCPStore("localhost", mine.port, 1, True))
    assert isinstance(j, errors.StoreListenError) and isinstance(j, _builtin_of(t))
    assert str(j).startswith(str(t).split(".")[0])  # torch's leading sentence
    # an op that does not fit the dtype (torch in a one-process gloo group)
    import torch

    from jdist.collectives._types import ReduceOp, check_op_dtype

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{jstore.free_port()}",
                            rank=0, world_size=1)
    try:
        for op, t_dtype, j_dtype in ((dist.ReduceOp.BAND, torch.float32, "float32"),
                                     (dist.ReduceOp.MAX, torch.complex64, "complex64")):
            t = _torch_exc(lambda op=op, d=t_dtype: dist.all_reduce(torch.ones(2, dtype=d), op))
            j = _torch_exc(lambda op=op, d=j_dtype: check_op_dtype(ReduceOp[op.name], d))
            assert isinstance(j, errors.UnsupportedOpError) and isinstance(j, _builtin_of(t))
            lead = str(t).split(" on ")[0].replace("RedOpType", "ReduceOp")
            assert lead in str(j), (str(t), str(j))
    finally:
        dist.destroy_process_group()
    # world size 0 and PrefixStore(None): torch ValueError, with the same words
    for make_t, make_j in (
            (lambda: dist.TCPStore("localhost", 0, world_size=0, is_master=True),
             lambda: jstore.TCPStore("localhost", 0, world_size=0, is_master=True)),
            (lambda: dist.PrefixStore("p", None), lambda: jstore.PrefixStore("p", None))):
        t, j = _torch_exc(make_t), _torch_exc(make_j)
        assert isinstance(j, _builtin_of(t)) and str(t) in str(j), (t, j)
