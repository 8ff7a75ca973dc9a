"""jdist.ft: training that survives a lost replica without restarting (torchft's API).

Each replica is one process (``jdist-run --ft`` starts them, hosts the store, and
starts a replacement for one that dies). Every step forms a quorum of the live
replicas, averages gradients over it, and commits only if every member succeeded; a
replica that joins heals parameters, optimizer state and the data position from a live
peer. docs/fault-tolerance.md says when to use it instead of restart-based resume.

| file | job |
| --- | --- |
| ``_rules.py`` | pure decisions: sealing, who heals from whom, sample split, weighted mean |
| ``_rounds.py`` | a round on the store: join, seal (``compare_set``), vote, decide |
| ``_pulse.py`` | heartbeats, liveness, where a silent replica stands (step, op, stack) |
| ``_peers.py`` | jdist's authenticated mailbox (``jdist/_mailbox.py``) with ft's errors |
| ``_state.py`` | a pytree's leaves as frames and back, checked |
| ``_healing.py`` | ``Registry``: the named state a replica heals (send, load) |
| ``_manager.py`` | ``Manager``: start_quorum, allreduce, should_commit, healing |
| ``_wrappers.py`` | ``DistributedDataParallel``, ``Optimizer``, ``DistributedSampler`` |
"""

from jdist.ft._manager import Manager as Manager
from jdist.ft._rounds import Quorum as Quorum
from jdist.ft._rules import split_counts as split_counts
from jdist.ft._rules import weighted_mean as weighted_mean
from jdist.ft._state import to_numpy as to_numpy
from jdist.ft._wrappers import DistributedDataParallel as DistributedDataParallel
from jdist.ft._wrappers import DistributedSampler as DistributedSampler
from jdist.ft._wrappers import Optimizer as Optimizer

__all__ = ["DistributedDataParallel", "DistributedSampler", "Manager", "Optimizer",
           "Quorum", "split_counts", "to_numpy", "weighted_mean"]
