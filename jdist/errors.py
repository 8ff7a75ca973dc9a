"""Error classes of jdist.

Each class's docstring says what causes it and how to fix it; messages quote the bad
value and name the fixing call. Classes derive from the builtin that a torch user would
catch (``RuntimeError``, ``ValueError``, ``TimeoutError``) as well as from
:class:`JdistError`, so ``except RuntimeError`` keeps working after a port.

Helpers add classes here with small, targeted edits; keep one class per failure mode.
"""

from __future__ import annotations

__all__ = [
    "JdistError",
    "NotInitializedError",
    "AlreadyInitializedError",
    "RendezvousError",
    "RendezvousTimeoutError",
    "StoreError",
    "StoreTimeoutError",
    "StoreAuthError",
    "StoreValueTooLargeError",
    "StoreListenError",
    "QueueEmptyError",
    "GroupMismatchError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "UnsupportedOpError",
    "ImmutableTargetError",
    "PeerFailedError",
    "BucketLayoutError",
    "NoParametersError",
    "UnusedParametersError",
    "ModelMismatchError",
    "ReplicaDivergenceError",
    "JoinError",
    "RpcError",
    "RpcTimeoutError",
    "RpcAuthError",
    "RemoteError",
    "WorkerUnavailableError",
    "RRefError",
    "UnknownWorkerError",
    "WorkerNameError",
    "DistAutogradError",
    "LossTypeError",
    "WeightConversionError",
    "FtError",
    "ReplicaLostError",
    "JobFinishedError",
]


class JdistError(Exception):
    """Base class of every error that jdist raises on purpose."""


class NotInitializedError(JdistError, RuntimeError, ValueError):
    """A runtime was used before it was started.

    torch raises ``ValueError`` ("Default process group has not been initialized") for
    process groups and ``RuntimeError`` for RPC; this error is both.

    Cause: a process-group or RPC function was called before
    ``jdist.init_process_group()`` (or ``jdist.rpc.init_rpc()``), or after it was torn down.
    Fix: call the init function first, in every process.
    """


class AlreadyInitializedError(JdistError, RuntimeError, ValueError):
    """An init function was called twice.

    torch raises ``ValueError`` ("trying to initialize the default process group
    twice!") for process groups and ``RuntimeError`` ("RPC is already initialized") for
    RPC; this error is both.

    Cause: ``init_process_group`` / ``init_rpc`` ran while a runtime was active.
    Fix: call ``destroy_process_group()`` / ``rpc.shutdown()`` first, or init once.
    """


class RendezvousError(JdistError, RuntimeError):
    """Processes could not agree on a job: world sizes, ranks or names disagree.

    Fix: give every process the same WORLD_SIZE and a distinct RANK (``jdist-run``
    sets both), and make sure they reach the same store.
    """


class RendezvousTimeoutError(RendezvousError, TimeoutError):
    """Some ranks never arrived at the rendezvous within the timeout.

    The message names the missing ranks. Fix: check that those processes started and
    reach MASTER_ADDR:MASTER_PORT, or raise ``timeout``.
    """


class StoreError(JdistError, RuntimeError):
    """A key-value store operation failed (connection lost, bad reply, value too big)."""


class StoreTimeoutError(StoreError, TimeoutError):
    """``get``/``wait`` on a store did not see the keys in time.

    The message names the keys and the time waited. Fix: make sure some process sets
    those keys, or raise the store timeout (``store.set_timeout``).
    """


class StoreAuthError(StoreError, PermissionError):
    """The store server refused this client's secret (or the client refused the server's).

    Fix: give every process of the job the same ``JDIST_AUTH_TOKEN`` (``jdist-run`` sets
    one per job) or pass the same ``auth_token=``.
    """


class StoreValueTooLargeError(StoreError, ValueError):
    """A store value (or one request) is bigger than the store's size cap.

    Fix: store large payloads elsewhere (a file, a collective) and put only a reference
    in the store, or raise ``max_value_bytes`` on the TCPStore server and clients.
    """


class StoreListenError(StoreError, OSError):
    """A ``TCPStore`` master could not listen on its address (usually: the port is taken).

    torch raises ``DistNetworkError`` (a ``RuntimeError``) with "The server socket has
    failed to listen on any local network address"; this is a ``RuntimeError`` with that
    text, and an ``OSError`` (``errno`` set) as Python's own ``bind`` failure is. Fix:
    pick another port (``port=0`` takes a free one; read it from ``TCPStore.port``) or
    stop the process that holds it.
    """


class QueueEmptyError(StoreError):
    """``store.queue_pop(key, block=False)`` found the queue empty (torch's
    ``QueueEmptyError``, a ``DistStoreError``, "queue is empty"). Fix: pop with
    ``block=True`` (waits up to the store timeout) or check ``queue_len`` first."""


class GroupMismatchError(JdistError, ValueError, RuntimeError):
    """A group query was given ``NON_GROUP_MEMBER``, or a rank that is not in the group.

    torch raises ``ValueError`` ("Invalid process group specified", "is not part of
    group") for queries and ``RuntimeError`` ("invalid root rank") for a bad ``src`` or
    ``dst``; this error is both. A *collective* called with ``NON_GROUP_MEMBER`` is not
    an error: as in torch it warns and returns None. Fix: check
    ``group is not jdist.NON_GROUP_MEMBER`` first, or pass a member's global rank.
    """


class CollectiveMismatchError(JdistError, RuntimeError):
    """Ranks called different collectives (op, shape, dtype or group) at the same step.

    torch with gloo returns a silently wrong result on one rank and times out on the
    other; jdist compares a fingerprint first and raises on every rank, naming each
    rank's call. Fix: make every rank issue the same collectives in the same order.
    Set ``JDIST_DEBUG=OFF`` to skip the check.
    """


class CollectiveTimeoutError(JdistError, RuntimeError, TimeoutError):
    """A collective or barrier did not complete within the group timeout.

    The message names the ranks that did not arrive. torch raises ``RuntimeError``
    (gloo's timeout, ``monitored_barrier``'s "Rank 1 failed to pass monitoredBarrier");
    this error is a ``RuntimeError`` and a ``TimeoutError``. Fix: make every member call
    the same collectives, or raise the group's timeout.
    """


class UnsupportedOpError(JdistError, TypeError, ValueError, RuntimeError):
    """A ``ReduceOp`` cannot reduce arrays of this dtype.

    Bitwise ops need integer or bool arrays, AVG needs a float (or complex) array, and
    complex arrays take only SUM and AVG. torch raises ``RuntimeError`` ("Cannot use
    ReduceOp.BAND with non-integral dtype") or, for complex arrays, ``ValueError``
    ("all_reduce does not support ... on complex tensors"); this error is both, and a
    ``TypeError``. Fix: cast the array, or pick an op its dtype supports.
    """


class ImmutableTargetError(JdistError, TypeError, RuntimeError):
    """An eager collective was asked to fill a ``jax.Array`` in place and its result
    was thrown away.

    torch's ``all_reduce(t)``, ``broadcast(t)``, ``recv(t)`` and the collectives with an
    output tensor update that tensor in place and return nothing; a JAX array cannot be
    changed, so jdist returns the result, and a call written as a statement would leave
    the old value to be read next (a silent wrong result). Raised on the calling rank
    when the output argument is a ``jax.Array`` and the call's result is not used. Fix:
    use the result (``x = jdist.all_reduce(x)``), or pass a numpy array, which is
    updated in place as in torch.
    """


class PeerFailedError(JdistError, RuntimeError):
    """A peer process died or disconnected while others depended on it.

    The message names the rank (or worker). Fix: look at that rank's own error first.
    """


class BucketLayoutError(JdistError, ValueError, RuntimeError):
    """DDP gradient buckets do not match the parameters (wrong cap, tree changed).

    torch's reducer raises ``RuntimeError`` when buckets and parameters disagree; this
    error is a ``RuntimeError`` and a ``ValueError``.
    """


class NoParametersError(JdistError, ValueError, RuntimeError):
    """DDP was given a module with no parameter to train.

    torch raises ``RuntimeError`` here; this error is also a ``ValueError``. Fix: there
    is nothing to average; run the module without DDP.
    """


class UnusedParametersError(JdistError, RuntimeError):
    """DDP found parameters that received no gradient in the first step.

    The message names the parameter paths. Fix: pass
    ``find_unused_parameters=True`` to ``DistributedDataParallel`` or make every
    parameter take part in the loss.
    """


class ModelMismatchError(JdistError, RuntimeError):
    """Processes wrapped different models in DDP (paths, shapes or dtypes differ).

    The message names the first differing parameter and each rank's shape.
    """


class ReplicaDivergenceError(JdistError, RuntimeError):
    """A DDP module's parameters differ between processes.

    They were changed outside DDP by a step that did not reduce gradients across
    processes (e.g. the user's own ``@nnx.jit`` train step called with each process's
    batch). The message names the ranks whose parameters differ from rank 0's. Fix: call
    the step with ``ddp.shard_batch(batch)``, or train with ``ddp.train_step`` /
    ``ddp.value_and_grad``.
    """


class JoinError(JdistError, RuntimeError):
    """A rank ran out of inputs under ``join(throw_on_early_termination=True)``."""


class RpcError(JdistError, RuntimeError):
    """An RPC failed in the framework (not in the user's remote function)."""


class RpcTimeoutError(RpcError, TimeoutError):
    """An RPC did not complete in time; the message names worker, function and time."""


class RpcAuthError(RpcError, PermissionError):
    """A peer failed the shared-secret challenge; nothing it sent was unpickled."""


class RemoteError(RpcError):
    """Wraps a remote exception whose type could not be re-created locally.

    When the type can be re-created, the original type is raised instead, with the
    remote traceback in its message.
    """


class WorkerUnavailableError(RpcError):
    """The destination worker is gone (connection dropped or it shut down)."""


class RRefError(RpcError):
    """An RRef was used in a way its owner/user role does not allow."""


class UnknownWorkerError(RpcError, ValueError):
    """An RPC names a worker (name or rank) that is not in the job.

    torch raises ``RuntimeError`` ("could not find destination"); this is also a
    ``ValueError`` (jdist's earlier type). Fix: use a name from
    ``get_worker_info()``'s job or a rank in ``0..world_size-1``.
    """


class WorkerNameError(RpcError, ValueError):
    """A worker name torch refuses ("Worker name must match ...", "must be non-empty",
    "shorter than 128"). Fix: 1-128 letters, digits, ``-``, ``_``, ``:`` or ``.``."""


class DistAutogradError(JdistError, RuntimeError):
    """Distributed autograd misuse: nested contexts, unknown context id, second backward."""


class LossTypeError(DistAutogradError, TypeError):
    """``dist_autograd.backward``'s loss is not a float scalar (torch: "is not a scalar,
    all roots need to be scalar", a ``RuntimeError``). Fix: reduce it (``jnp.sum``) or
    pass ``has_aux=True`` for ``(loss, aux)``."""


class WeightConversionError(JdistError, ValueError, RuntimeError):
    """Weights could not be copied between a torch module and a Flax NNX module.

    torch's ``load_state_dict`` raises ``RuntimeError`` on such mismatches; this error
    is a ``RuntimeError`` and a ``ValueError``.
    Cause: the two models' convertible layers differ in number, kind, shape or
    hyperparameters (epsilon, momentum, stride, padding, ...), or a layer holding
    parameters is not supported. The message names both layer paths. Fix: define the
    same layers in the same order with the same settings, or pass ``strict=False`` /
    ``check_config=False`` to ``jdist.testing.torch_to_nnx`` / ``nnx_to_torch``.
    """


class FtError(JdistError, RuntimeError):
    """``jdist.ft`` could not form a quorum, heal, or reach its store or peers.

    The message names the replica and the step. Fix: start the job with ``jdist-run
    --ft`` (it hosts the store and sets ``JDIST_FT_STORE`` and ``JDIST_AUTH_TOKEN``), or
    pass ``store=`` and ``auth_token=`` to :class:`jdist.ft.Manager`; raise
    ``timeout=`` for slow steps."""


class ReplicaLostError(FtError, ConnectionError):
    """A replica of the quorum died, stopped, or stayed silent during a step.

    ``jdist.ft`` catches it inside the step: the step does not commit
    (``should_commit()`` is False) and the next quorum goes on without that replica.
    The message names the replica, its step, the operation it had not entered and its
    last published Python stack."""


class JobFinishedError(FtError):
    """The other replicas ended the job (``Manager.finish``) before this one joined a
    quorum: there is nothing left to train. A replacement started late exits with it;
    catch it to end cleanly."""
