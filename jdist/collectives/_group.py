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

from jdist.errors import GroupMismatchError, NotInitializedError

__all__ = [
    "DEFAULT_AXIS",
    "ProcessGroup",
    "GroupState",
    "group_state",
    "NON_GROUP_MEMBER",
    "make_mesh",
    "resolve_group",
    "local_group",
    "is_initialized",
    "get_default_group",
    "get_rank",
    "get_world_size",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "new_group",
    "timeout_seconds",
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
    """Holds the default (WORLD) group and the process's runtime handles.

    Attributes:
      default_group: the WORLD group, or None before ``init_process_group``.
      groups: every group made by ``new_group`` on this process (members or not, in
        creation order; ``NON_GROUP_MEMBER`` entries are not kept).
      runtime: handles owned by ``jdist.collectives._init`` (store, watchdog, flags).
      num_new_groups: how many ``new_group`` calls this process made since init; all
        ranks call ``new_group`` in the same order, so this numbers groups consistently.
    """

    def __init__(self) -> None:
        self.default_group: ProcessGroup | None = None
        self.groups: list[ProcessGroup] = []
        self.runtime: dict = {}
        self.num_new_groups = 0
        self.generation = 0  # inits so far in this process (kept across reset)

    def reset(self) -> None:
        """Forget every group and runtime handle (after ``destroy_process_group``)."""
        self.default_group = None
        self.groups = []
        self.runtime = {}
        self.num_new_groups = 0

    def is_initialized(self) -> bool:
        return self.default_group is not None

    def require(self, what: str = "this call") -> ProcessGroup:
        if self.default_group is None:
            raise NotInitializedError(
                f"Default process group has not been initialized, please make sure to call "
                f"init_process_group. ({what} needs it; call jdist.init_process_group() "
                f"first, in every process)"
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
        raise GroupMismatchError(
            "Invalid process group specified: this process is not a member of the group "
            "(got NON_GROUP_MEMBER); only members of a group may use it (check `group is "
            "not jdist.NON_GROUP_MEMBER`)"
        )
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"group must be a jdist ProcessGroup or None, got {group!r}")
    return group


# ---------------------------------------------------------------------------
# Queries on groups (torch.distributed's get_rank / get_world_size / ...)
# ---------------------------------------------------------------------------


def _group_or_default(group: ProcessGroup | None, what: str) -> ProcessGroup:
    default = group_state.require(what)
    if group is None:
        return default
    if group is NON_GROUP_MEMBER:
        raise GroupMismatchError(
            f"Invalid process group specified: {what} was given NON_GROUP_MEMBER, so this "
            f"process is not a member of that group; only members may use it (check "
            f"`group is not jdist.NON_GROUP_MEMBER`)"
        )
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"group must be a jdist ProcessGroup or None, got {group!r}")
    return group


def is_initialized() -> bool:
    """Whether ``init_process_group`` has run (and ``destroy_process_group`` has not)."""
    return group_state.is_initialized()


def get_default_group() -> ProcessGroup:
    """The WORLD group made by ``init_process_group``.

    Raises:
      NotInitializedError: before ``init_process_group``.
    """
    return group_state.require("jdist.get_default_group()")


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: WORLD), as ``torch.distributed.get_rank``.

    Returns -1 when ``group`` is ``NON_GROUP_MEMBER``, as torch does for non-members.
    """
    if group is NON_GROUP_MEMBER:
        group_state.require("jdist.get_rank()")
        return -1
    return _group_or_default(group, "jdist.get_rank()").rank


def get_world_size(group: ProcessGroup | None = None) -> int:
    """Number of processes in ``group`` (default: WORLD); -1 for ``NON_GROUP_MEMBER``."""
    if group is NON_GROUP_MEMBER:
        group_state.require("jdist.get_world_size()")
        return -1
    return _group_or_default(group, "jdist.get_world_size()").size()


def get_backend(group: ProcessGroup | None = None) -> str:
    """The group's backend: ``"gloo"`` (CPU) or ``"nccl"`` (GPU)."""
    return _group_or_default(group, "jdist.get_backend()").backend


def get_global_rank(group: ProcessGroup, group_rank: int) -> int:
    """The WORLD rank of ``group``'s member number ``group_rank``.

    Raises:
      ValueError: ``group_rank`` is not in ``[0, group size)``.
    """
    g = _group_or_default(group, "jdist.get_global_rank()")
    if not isinstance(group_rank, int) or not 0 <= group_rank < g.size():
        raise GroupMismatchError(
            f"group_rank {group_rank!r} is not a rank of group {g.name!r}, which has ranks "
            f"0..{g.size() - 1} (global ranks {list(g.ranks)})"
        )
    return g.ranks[group_rank]


def get_group_rank(group: ProcessGroup, global_rank: int) -> int:
    """The rank inside ``group`` of the process with WORLD rank ``global_rank``.

    Raises:
      ValueError: that process is not a member of ``group``.
    """
    g = _group_or_default(group, "jdist.get_group_rank()")
    if global_rank not in g.ranks:
        raise GroupMismatchError(
            f"Global rank {global_rank!r} is not part of group {g.name!r} "
            f"(members: {list(g.ranks)}); pass a member's global rank"
        )
    return g.ranks.index(global_rank)


def get_process_group_ranks(group: ProcessGroup | None = None) -> list[int]:
    """The WORLD ranks of ``group``'s members, in group-rank order."""
    return list(_group_or_default(group, "jdist.get_process_group_ranks()").ranks)


def timeout_seconds(timeout, default: float, what: str, allow_zero: bool = False) -> float:
    """Seconds from a ``timedelta`` or a number; ``None`` gives ``default``.

    Raises:
      ValueError: not a number/timedelta, negative, or 0 where ``allow_zero`` is off.
    """
    if timeout is None:
        return float(default)
    seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
    if (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0
            or (seconds == 0 and not allow_zero)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{what}: timeout must be a datetime.timedelta or seconds {bound}, "
                         f"got {timeout!r}")
    return float(seconds)


def new_group(ranks=None, timeout=None, backend=None) -> ProcessGroup | _NonGroupMember:
    """A sub-group of WORLD over ``ranks`` (torch's ``new_group``).

    Every WORLD process must call it, in the same order, members or not (as in torch).
    The group has its own mesh over the members' devices (process-major) and its own
    axis name ``"pg<k>"``, where ``k`` counts ``new_group`` calls since init.

    Args:
      ranks: WORLD ranks of the members (sorted and de-duplicated, as torch's default
        ``sort_ranks=True``); ``None`` means all ranks.
      timeout: seconds (or ``timedelta``) for blocking calls on the group; default WORLD's.
      backend: must be None or WORLD's backend (one backend per job here).

    Returns:
      The new ``ProcessGroup`` on members, ``NON_GROUP_MEMBER`` elsewhere.

    Raises:
      NotInitializedError: before ``init_process_group``.
      ValueError: a rank outside ``[0, world_size)`` or an empty list.
    """
    world = group_state.require("jdist.new_group()")
    n = world.size()
    members = tuple(range(n)) if ranks is None else tuple(sorted(set(int(r) for r in ranks)))
    bad = [r for r in members if not 0 <= r < n]
    if bad or not members:
        raise ValueError(
            f"new_group(ranks={ranks!r}): ranks must be a non-empty list of WORLD ranks in "
            f"[0, {n - 1}]; bad: {bad or 'empty list'}"
        )
    if backend is not None and str(backend).lower() != world.backend:
        raise ValueError(
            f"new_group(backend={backend!r}): this job's backend is {world.backend!r}; "
            f"pass backend=None"
        )
    group_state.num_new_groups += 1
    k = group_state.num_new_groups
    if world.rank not in members:
        return NON_GROUP_MEMBER
    if timeout is None:
        seconds = world.timeout
    else:
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
    devs = tuple(world.devices_per_rank[r] for r in members)
    axis = f"pg{k}"
    group = ProcessGroup(
        ranks=members,
        rank=members.index(world.rank),
        mesh=make_mesh([d for ds in devs for d in ds], axis),
        axis_name=axis,
        backend=world.backend,
        devices_per_rank=devs,
        name=f"group{k}",
        timeout=float(seconds),
        extra={"global_rank": world.rank},
    )
    group_state.groups.append(group)
    return group
