"""Gradient buckets: torch's assignment rules, as pure functions over parameter metadata.

torch's ``Reducer`` groups parameters into buckets so that one collective carries many
small gradients (torch's ``_compute_bucket_assignment_by_size`` and the ``Reducer``'s
bucket rebuild):

- parameters are walked in a given order with **one open bucket per dtype**; a bucket
  closes as soon as its byte count **reaches** the current limit (so it may exceed it);
- limits come from a sequence ``[first, ..., last]``: each new bucket of a dtype takes the
  next limit, the last one repeating;
- at construction (torch's iteration 0) parameters are walked in registration order and
  the buckets are sorted by smallest parameter index and **reversed**, so bucket 0 holds
  the last-registered parameters (ready first in the backward pass);
- after the first backward, buckets are rebuilt once in **gradient-ready order** with
  limits ``[first_cap, cap]`` and kept in that order.

Sizes (:class:`BucketCapacityConfig`, torch's ``_BucketCapacityConfig``):
``bucket_cap_mb=None`` means a 25 MiB cap with a 1 MiB first bucket; an explicit
``bucket_cap_mb`` uses that cap for every bucket, the first one included; a
``bucket_cap_mb_list`` gives bucket ``k`` the ``k``-th cap (the last one repeating) and
takes precedence over ``bucket_cap_mb``.

Everything here is pure: no JAX tracing, only shapes, dtypes and paths.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from jdist.errors import BucketLayoutError

__all__ = [
    "BucketCapacityConfig",
    "DEFAULT_BUCKET_CAP_MB",
    "MB_TO_BYTES",
    "DEFAULT_FIRST_BUCKET_BYTES",
    "LeafInfo",
    "Bucket",
    "BucketLayout",
    "bucket_cap_bytes",
    "compute_bucket_assignment_by_size",
    "initial_layout",
    "rebuilt_layout",
    "make_layout",
]

DEFAULT_BUCKET_CAP_MB = 25
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
MB_TO_BYTES = 1024 * 1024


class LeafInfo(NamedTuple):
    """Metadata of one parameter: its path, shape, dtype name and byte size."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    @classmethod
    def of(cls, path: str, value) -> LeafInfo:
        """Metadata of ``value`` (anything with ``shape`` and ``dtype``)."""
        shape = tuple(int(d) for d in value.shape)
        dtype = np.dtype(value.dtype)
        return cls(path, shape, dtype.name, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64))


class Bucket(NamedTuple):
    """One bucket: parameter indices (into the leaf list), their paths, total bytes."""

    index: int
    leaves: tuple[int, ...]
    paths: tuple[str, ...]
    nbytes: int
    dtype: str

    def __repr__(self) -> str:
        return (f"Bucket(index={self.index}, nbytes={self.nbytes:,}, "
                f"params={len(self.leaves)}, paths={list(self.paths)})")


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """A complete assignment of parameters to buckets, in reduction order.

    ``layout[i]`` is bucket ``i`` (its ``paths`` and ``nbytes``); ``len(layout)`` is the
    number of buckets, and iterating yields them in reduction order.

    Attributes:
      buckets: the buckets, bucket 0 reduced first.
      leaves: metadata of every parameter, in registration order.
      rebuilt: whether the layout follows the recorded gradient-ready order.
    """

    buckets: tuple[Bucket, ...]
    leaves: tuple[LeafInfo, ...]
    rebuilt: bool

    def __getitem__(self, index: int) -> Bucket:
        return self.buckets[index]

    def __len__(self) -> int:
        return len(self.buckets)

    def __iter__(self):
        return iter(self.buckets)

    def sizes(self) -> list[int]:
        """Byte size of each bucket, bucket 0 first (torch's ``bucket_sizes``)."""
        return [b.nbytes for b in self.buckets]

    def counts(self) -> list[int]:
        """Number of parameters in each bucket."""
        return [len(b.leaves) for b in self.buckets]

    def __repr__(self) -> str:
        body = ",\n  ".join(repr(b) for b in self.buckets)
        return f"BucketLayout(rebuilt={self.rebuilt}, buckets=[\n  {body}])"


def _check_mb(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise BucketLayoutError(
            f"{name} must be a positive number of MiB, got {value!r}; pass None for "
            f"torch's default ({DEFAULT_BUCKET_CAP_MB} MiB with a 1 MiB first bucket)")


@dataclasses.dataclass(frozen=True)
class BucketCapacityConfig:
    """The byte limits of DDP's gradient buckets, from ``bucket_cap_mb`` and
    ``bucket_cap_mb_list`` (torch's ``_BucketCapacityConfig``; immutable).

    Attributes:
      bucket_bytes_cap: the cap of every bucket (the largest of a list).
      per_bucket_bytes_caps: one cap per bucket from ``bucket_cap_mb_list``, in bytes
        (empty: every bucket uses ``bucket_bytes_cap``).
      first_bucket_bytes_cap: the first bucket's cap (1 MiB with the defaults, so the
        first all-reduce starts early; else ``bucket_bytes_cap``).
    """

    bucket_bytes_cap: int
    per_bucket_bytes_caps: tuple[int, ...]
    first_bucket_bytes_cap: int

    @classmethod
    def create(cls, bucket_cap_mb: float | None = None,
               bucket_cap_mb_list: Sequence[float] | None = None) -> BucketCapacityConfig:
        """The config of a DDP built with these arguments (a non-empty list wins).

        Raises:
          BucketLayoutError: a cap is not a positive number.
        """
        if bucket_cap_mb is not None:
            _check_mb("bucket_cap_mb", bucket_cap_mb)
        caps: tuple[int, ...] = ()
        if bucket_cap_mb_list:
            for c in bucket_cap_mb_list:
                _check_mb("every entry of bucket_cap_mb_list", c)
            caps = tuple(int(c * MB_TO_BYTES) for c in bucket_cap_mb_list)
            cap = max(caps)
        else:
            cap = int((DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb)
                      * MB_TO_BYTES)
        default = bucket_cap_mb is None and not caps
        return cls(cap, caps, DEFAULT_FIRST_BUCKET_BYTES if default else cap)

    @property
    def bucket_cap_mb(self) -> int:
        """``bucket_bytes_cap`` in whole MiB."""
        return self.bucket_bytes_cap // MB_TO_BYTES

    @property
    def has_custom_per_bucket_caps(self) -> bool:
        """Whether a ``bucket_cap_mb_list`` gives each bucket its own cap."""
        return bool(self.per_bucket_bytes_caps)

    def rebuild_limits(self) -> list[int]:
        """The limits of the layout rebuilt in gradient-ready order."""
        if self.has_custom_per_bucket_caps:
            return list(self.per_bucket_bytes_caps)
        return [self.first_bucket_bytes_cap, self.bucket_bytes_cap]

    def compute_bucket_size_limits(self, static_graph: bool, find_unused_parameters: bool
                                   ) -> tuple[list[int], list[int]]:
        """``(construction limits, rebuild limits)`` as torch's reducer receives them.

        The construction layout (torch's iteration 0) is one bucket (``sys.maxsize``)
        unless parameters may go unused; the rebuild list is empty when the default rule
        (:meth:`rebuild_limits`) applies, and the custom caps otherwise.
        """
        if self.has_custom_per_bucket_caps:
            caps = list(self.per_bucket_bytes_caps)
            return caps, list(caps)
        if static_graph or not find_unused_parameters:
            return [sys.maxsize], []
        if self.first_bucket_bytes_cap < self.bucket_bytes_cap:
            return [self.first_bucket_bytes_cap, self.bucket_bytes_cap], []
        return [self.bucket_bytes_cap], []


def _config(caps) -> BucketCapacityConfig:
    return caps if isinstance(caps, BucketCapacityConfig) else BucketCapacityConfig.create(caps)


def bucket_cap_bytes(bucket_cap_mb: float | BucketCapacityConfig | None) -> tuple[int, int]:
    """``(first_bucket_bytes, bucket_bytes)`` for a ``bucket_cap_mb`` argument, as torch.

    Raises:
      BucketLayoutError: ``bucket_cap_mb`` is not a positive number.
    """
    c = _config(bucket_cap_mb)
    return c.first_bucket_bytes_cap, c.bucket_bytes_cap


def compute_bucket_assignment_by_size(
    sizes: Sequence[int],
    dtypes: Sequence[str],
    limits: Sequence[int],
    order: Sequence[int] | None = None,
) -> list[list[int]]:
    """torch's ``_compute_bucket_assignment_by_size`` over byte sizes.

    Args:
      sizes: byte size of each parameter (indexed by parameter index).
      dtypes: dtype name of each parameter; each dtype has its own open bucket.
      limits: bucket byte limits; bucket ``k`` of a dtype uses ``limits[min(k, -1)]``.
      order: the order to walk parameter indices in. ``None`` walks them in index order
        and sorts the result by smallest index (torch without ``tensor_indices``);
        otherwise buckets keep the order in which they were filled.

    Returns:
      A list of buckets, each a list of parameter indices in walk order.
    """
    if len(sizes) != len(dtypes):
        raise BucketLayoutError(f"{len(sizes)} sizes but {len(dtypes)} dtypes")
    if not limits or any(int(x) <= 0 for x in limits):
        raise BucketLayoutError(f"bucket limits must be positive byte counts, got {list(limits)}")
    walk = list(range(len(sizes))) if order is None else [int(i) for i in order]
    if sorted(walk) != list(range(len(sizes))):
        raise BucketLayoutError(
            f"order must be a permutation of range({len(sizes)}), got {walk}"
        )
    done: list[list[int]] = []
    open_: dict[str, tuple[list[int], int]] = {}
    limit_pos: dict[str, int] = {}
    for i in walk:
        key = dtypes[i]
        members, nbytes = open_.get(key, ([], 0))
        members.append(i)
        nbytes += int(sizes[i])
        k = limit_pos.get(key, 0)
        if nbytes >= int(limits[min(k, len(limits) - 1)]):
            done.append(members)
            open_.pop(key, None)
            limit_pos[key] = k + 1
        else:
            open_[key] = (members, nbytes)
    done.extend(members for members, _ in open_.values() if members)
    if order is None:
        done.sort(key=min)
    return done


def make_layout(
    leaves: Sequence[LeafInfo], groups: Sequence[Sequence[int]], rebuilt: bool
) -> BucketLayout:
    """A :class:`BucketLayout` from groups of parameter indices (bucket 0 first)."""
    buckets = []
    for bi, g in enumerate(groups):
        idx = tuple(int(i) for i in g)
        buckets.append(Bucket(
            index=bi,
            leaves=idx,
            paths=tuple(leaves[i].path for i in idx),
            nbytes=sum(leaves[i].nbytes for i in idx),
            dtype=leaves[idx[0]].dtype if idx else "",
        ))
    return BucketLayout(tuple(buckets), tuple(leaves), rebuilt)


def initial_layout(
    leaves: Sequence[LeafInfo], bucket_cap_mb: float | BucketCapacityConfig | None,
    find_unused_parameters: bool
) -> BucketLayout:
    """torch's construction-time layout (its iteration 0).

    Without ``find_unused_parameters`` (and without per-bucket caps) this is one bucket
    of everything (torch delays all reduction of the first iteration to its end);
    otherwise the config's limits in registration order, sorted and reversed. jdist
    replaces the single bucket by the rebuilt layout before the first step is compiled,
    so no step runs with it. ``bucket_cap_mb`` may be a :class:`BucketCapacityConfig`.
    """
    limits, _ = _config(bucket_cap_mb).compute_bucket_size_limits(
        False, find_unused_parameters)
    groups = compute_bucket_assignment_by_size(
        [x.nbytes for x in leaves], [x.dtype for x in leaves], limits
    )
    groups = [list(g) for g in reversed(groups)]
    return make_layout(leaves, groups, rebuilt=False)


def rebuilt_layout(
    leaves: Sequence[LeafInfo], ready_order: Sequence[int],
    bucket_cap_mb: float | BucketCapacityConfig | None
) -> BucketLayout:
    """The layout rebuilt in gradient-ready order (``ready_order[0]`` ready first)."""
    groups = compute_bucket_assignment_by_size(
        [x.nbytes for x in leaves], [x.dtype for x in leaves],
        _config(bucket_cap_mb).rebuild_limits(), order=ready_order
    )
    return make_layout(leaves, groups, rebuilt=True)
