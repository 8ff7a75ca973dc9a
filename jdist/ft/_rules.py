"""The pure decisions of ``jdist.ft`` (no I/O, no JAX): when a round's quorum may be
sealed, who heals from whom, how a step's samples are split, and the weighted mean.

Every replica evaluates these on the same inputs (read from the store), and the
sealed outcome is written once (``compare_set``), so replicas never act on two
different answers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from jdist._aligned import aligned_empty

__all__ = ["may_seal", "heal_plan", "split_counts", "weighted_mean"]


def may_seal(expected: Sequence[int], joined: Sequence[int], live: Sequence[int],
             min_replicas: int, waited: float, join_timeout: float) -> bool:
    """Whether a round that ``joined`` (replica ids) have joined may be sealed now.

    ``expected`` are the members of the previous round (all replicas for the first),
    ``live`` the replicas whose heartbeat is fresh. The round waits for every expected
    replica that is still live; a live one that does not join within ``join_timeout``
    seconds (stuck, or slow to start) is left out. Never fewer than ``min_replicas``.
    """
    if len(set(joined)) < min_replicas:
        return False
    missing = (set(expected) & set(live)) - set(joined)
    return not missing or waited >= join_timeout


def heal_plan(steps: Mapping[int, int], synced: Mapping[int, bool]) -> dict[int, int]:
    """``{healer: source}``: which members load the state of which other member.

    ``steps`` is each member's lineage (the manager passes the round of its last
    commit: two replicas with the same one hold the same state) and ``synced`` whether
    it has taken part in a round before. The sources are the synced members at the
    highest value (or, when none is synced - the first round - the lowest id at that
    value); every other member heals, the i-th from source ``i mod len(sources)``.
    """
    if not steps:
        return {}
    top = max(steps.values())
    sources = sorted(r for r, s in steps.items() if s == top and synced.get(r, False))
    if not sources:
        sources = [min(r for r, s in steps.items() if s == top)]
    healers = sorted(r for r in steps if r not in sources)
    return {h: sources[i % len(sources)] for i, h in enumerate(healers)}


def split_counts(remaining: int, members: int, batch_size: int) -> list[int]:
    """How many samples each of ``members`` takes this step: ``batch_size`` each while
    the epoch has enough left, else the ``remaining`` ones as evenly as possible (the
    first members take one more)."""
    if members < 1 or batch_size < 1 or remaining < 0:
        raise ValueError(f"split_counts needs members >= 1, batch_size >= 1 and "
                         f"remaining >= 0, got {members}, {batch_size}, {remaining}")
    take = min(remaining, members * batch_size)
    base, extra = divmod(take, members)
    return [base + (1 if i < extra else 0) for i in range(members)]


def weighted_mean(parts: Sequence[Sequence[np.ndarray]], counts: Sequence[int]
                  ) -> list[np.ndarray]:
    """``sum_i (counts[i] / sum(counts)) * parts[i]``, leaf by leaf, in member order.

    Each member's leaves are its mean over its own samples, so this is the mean over
    every sample of the step. The order and the arithmetic (each leaf's dtype) are
    fixed, so every replica, and a replay, gets the same bits. Each result is 64-byte
    aligned: XLA on CPU then takes it as a jax.Array without a copy (numpy's own
    arrays are 16-byte aligned, and a step's gradients cost a copy of the model).
    """
    total = int(sum(counts))
    if not parts or total <= 0 or min(counts) < 0:
        raise ValueError(f"weighted_mean needs at least one sample, got counts {list(counts)}")
    out = []
    for leaves in zip(*parts, strict=True):
        dtype = leaves[0].dtype
        acc = tmp = None
        for leaf, n in zip(leaves, counts, strict=True):
            if not n:
                continue
            w = dtype.type(n / total)
            if acc is None:
                acc = aligned_empty(np.shape(leaf), dtype)  # (0-d stays an array)
                np.multiply(leaf, w, out=acc, dtype=dtype)
            else:
                tmp = np.empty_like(acc) if tmp is None else tmp
                np.multiply(leaf, w, out=tmp, dtype=dtype)
                np.add(acc, tmp, out=acc)
        out.append(acc)
    return out
