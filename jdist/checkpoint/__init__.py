"""jdist.checkpoint: checkpoints of a whole training state, and exact resume (on Orbax).

``CheckpointManager(directory, save_interval_steps=..., max_to_keep=...,
async_save=True)`` saves one training state, a dict of named values: NNX modules and
optimizers (parameters, buffers such as BatchNorm statistics, optax state), DDP
wrappers (with their comm hook's per-replica state: PowerSGD error feedback and Q
memories), ``ZeroRedundancyOptimizer`` shards (each rank writes its own),
``DistributedSampler`` positions, ``nnx.Rngs`` and numpy ``Generator`` states, plain
pytrees (Linen / ``FunctionalDDP`` users) and JSON-able extras.

Each rank writes its part as one Orbax checkpoint (atomic: written under a temporary
name, renamed when complete); a step counts once every rank's part is there, and
restore takes the newest such step, checks every buffer's checksum, and falls back to
the previous complete step when a part is broken. ``state =
manager.restore_or_init(init)`` is the whole resume logic of a training script run
under ``jdist-run --max-restarts K``. See ``docs/fault-tolerance.md``.
"""

from jdist.checkpoint._elastic import ResumedSampler as ResumedSampler
from jdist.checkpoint._errors import CheckpointCorruptError as CheckpointCorruptError
from jdist.checkpoint._errors import CheckpointError as CheckpointError
from jdist.checkpoint._errors import CheckpointMismatchError as CheckpointMismatchError
from jdist.checkpoint._leaves import PerRank as PerRank
from jdist.checkpoint._manager import CheckpointManager as CheckpointManager
from jdist.checkpoint._manager import restart_count as restart_count

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "PerRank",
    "ResumedSampler",
    "restart_count",
]
