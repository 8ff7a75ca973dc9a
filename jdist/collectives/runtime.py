"""What jdist's own packages (DDP, ZeRO, DataParallel, the sampler) build on: the
process-group runtime below the torch-facing API.

Not part of ``torch.distributed``'s surface (so not in ``jdist.collectives.__all__``),
but published: the packages above import it from here, never from the collectives'
private modules, so those stay free to change. Names and jobs:

- ``ProcessGroup``, ``resolve_group``, ``group_state``: groups and the runtime state;
- ``DEFAULT_AXIS``, ``make_mesh``, ``axis_of``, ``bound_size``, ``is_bound``: mesh axes;
- ``ReduceOp``;
- ``enter_step``, ``behind_text``, ``is_runtime_failure``, ``peer_failure``: numbering
  compiled steps in the heartbeat and turning a runtime failure into an error that
  names the dead or stuck rank;
- ``main_stack``, ``process_state``: the forensics a heartbeat publishes (the main
  thread's Python stack; a local process's state letter, ``T`` when stopped);
- ``uncommitted``: a host array as an uncommitted jax.Array, without
  ``jax.device_put``'s Python dispatch (RPC's received arrays).
"""

from jdist.collectives._axis import axis_of as axis_of
from jdist.collectives._axis import bound_size as bound_size
from jdist.collectives._axis import is_bound as is_bound
from jdist.collectives._engine import behind_text as behind_text
from jdist.collectives._engine import enter_step as enter_step
from jdist.collectives._engine import is_runtime_failure as is_runtime_failure
from jdist.collectives._engine import peer_failure as peer_failure
from jdist.collectives._group import DEFAULT_AXIS as DEFAULT_AXIS
from jdist.collectives._group import ProcessGroup as ProcessGroup
from jdist.collectives._group import group_state as group_state
from jdist.collectives._group import make_mesh as make_mesh
from jdist.collectives._group import resolve_group as resolve_group
from jdist.collectives._result import uncommitted as uncommitted
from jdist.collectives._types import ReduceOp as ReduceOp
from jdist.collectives._watchdog import main_stack as main_stack
from jdist.collectives._watchdog import process_state as process_state

__all__ = ["DEFAULT_AXIS", "ProcessGroup", "ReduceOp", "axis_of", "behind_text",
           "bound_size", "enter_step", "group_state", "is_bound", "is_runtime_failure",
           "main_stack", "make_mesh", "peer_failure", "process_state", "resolve_group"]
