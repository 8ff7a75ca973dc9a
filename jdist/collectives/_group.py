"""ProcessGroup: a set of processes, the mesh of their devices, and its axis name.

One module singleton, ``group_state`` (a :class:`GroupState`), holds the default
group once ``init_process_group`` has run, as ``jax._src.distributed.global_state`` does
for JAX. Tests may build their own ``GroupState``.

Without ``init_process_group`` nothing is global: :func:`resolve_group` with ``None``
returns an *embedded* group over this process's local devices, so single-process code
(DDP, DataParallel, in-graph collectives) works without a launcher.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jdist.errors import NotInitializedError

__all__ = [
    "DEFAULT_AXIS",
    "ProcessGroup",
    "GroupState",
    "group_state",
    "NON_GROUP_MEMBER",
    "make_mesh",
    "resolve_group",
    "local_group",
]

DEFAULT_AXIS = "dp"


class _NonGroupMember:
    """Sentinel returned by ``new_group`` on processes outside the group."""

    def __repr__(self) -> str:
        return "NON_GROUP_MEMBER"

    def __bool__(self) -> bool:
        return False


NON_GROUP_MEMBER = _NonGroupMember()


def make_mesh(devices, axis_name: str = DEFAULT_AXIS) -> Mesh:
    """A 1-D mesh over ``devices`` with an Auto axis (works with ``shard_map`` specs)."""
    devs = np.asarray(list(devices), dtype=object)
    return Mesh(devs, (axis_name,), axis_types=(AxisType.Auto,))


@dataclasses.dataclass(frozen=True, eq=False)
class ProcessGroup:
    """A group of processes and the 1-D mesh of all their devices.

    Attributes:
      ranks: global process ranks of the members, in group-rank order.
      rank: this process's rank inside the group.
      mesh: 1-D mesh over every member's devices, process-major, axis ``axis_name``.
      axis_name: the mesh axis name to use inside ``shard_map`` (``"dp"`` for WORLD).
      backend: ``"gloo"``, ``"nccl"`` or ``"local"`` (embedded single process).
      devices_per_rank: for each member (group-rank order), its devices in mesh order.
      name: a unique name, used in cache keys and error messages.
      timeout: seconds any blocking call on this group waits before raising.
      extra: runtime-specific data (store, sequence counters) owned by the runtime.
    """

    ranks: tuple[int, ...]
    rank: int
    mesh: Mesh
    axis_name: str
    backend: str
    devices_per_rank: tuple[tuple[Any, ...], ...]
    name: str = "WORLD"
    timeout: float = 1800.0
    extra: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def size(self) -> int:
        """Number of processes in the group."""
        return len(self.ranks)

    @property
    def num_replicas(self) -> int:
        """Number of devices (data-parallel replicas) in the group."""
        return int(self.mesh.devices.size)

    @property
    def local_devices(self) -> tuple[Any, ...]:
        """This process's devices in the group, in mesh order."""
        return self.devices_per_rank[self.rank]

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return (
            f"ProcessGroup(name={self.name!r}, ranks={list(self.ranks)}, rank={self.rank}, "
            f"axis={self.axis_name!r}, devices={self.num_replicas}, backend={self.backend!r})"
        )


class GroupState:
    """Holds the default (WORLD) group and the process's runtime handles."""

    def __init__(self) -> None:
        self.default_group: ProcessGroup | None = None
        self.groups: list[ProcessGroup] = []
        self.runtime: dict = {}

    def is_initialized(self) -> bool:
        return self.default_group is not None

    def require(self, what: str = "this call") -> ProcessGroup:
        if self.default_group is None:
            raise NotInitializedError(
                f"{what} needs the default process group, which has not been initialized; "
                f"call jdist.init_process_group() first (in every process)"
            )
        return self.default_group


group_state = GroupState()

_LOCAL_GROUP: ProcessGroup | None = None


def local_group() -> ProcessGroup:
    """The embedded group: this process alone, all of its local devices, axis ``"dp"``."""
    global _LOCAL_GROUP
    devices = tuple(jax.local_devices())
    if _LOCAL_GROUP is None or _LOCAL_GROUP.devices_per_rank[0] != devices:
        _LOCAL_GROUP = ProcessGroup(
            ranks=(0,),
            rank=0,
            mesh=make_mesh(devices),
            axis_name=DEFAULT_AXIS,
            backend="local",
            devices_per_rank=(devices,),
            name="LOCAL",
        )
    return _LOCAL_GROUP


def resolve_group(group: ProcessGroup | None) -> ProcessGroup:
    """``group`` itself, else the default group, else the embedded local group."""
    if group is None:
        return group_state.default_group or local_group()
    if group is NON_GROUP_MEMBER:
        raise ValueError(
            "this process is not a member of the group (got NON_GROUP_MEMBER); "
            "only members of a group may call collectives on it"
        )
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"group must be a jdist ProcessGroup or None, got {group!r}")
    return group
