"""The kinds of values a training state holds, and how each is saved and restored.

A state is a dict ``{name: value}``; each value is one of:

- ``nnx``: an NNX graph node (``nnx.Module``, ``nnx.Optimizer``): ``nnx.state`` is
  saved; restore writes it back in place with ``nnx.update`` (the same Variables, so
  a DDP ``train_step`` bound to them keeps working);
- ``rngs``: an ``nnx.Rngs`` given as a state value: the same, but each rank's own
  (ranks usually draw different streams);
- ``ddp``: a :class:`~jdist.ddp.DistributedDataParallel` (its NNX module) or a
  :class:`~jdist.ddp.FunctionalDDP` (its ``params``, ``buffers`` and ``opt_state``
  pytrees; build ``opt_state = tx.init(params)`` in ``init()`` to have it saved), and
  its comm hook's per-replica state (PowerSGD error feedback and Q memories), all
  restored in place;
- ``sampler``: anything with ``state_dict``/``load_state_dict``/``set_epoch``
  (:class:`~jdist.sampler.DistributedSampler`): each rank's ``state_dict()``;
- ``np_rng``: a ``numpy.random.Generator``: each rank's bit generator state, restored
  in place;
- ``json``: ``None``, bools, numbers, strings, and lists/dicts of them: each rank's
  value (the step, the epoch, counters, a history);
- ``per_rank``: :class:`PerRank` around a pytree of arrays: each rank's value;
- ``tree``: any other pytree of arrays (Linen parameters, an optax state): returned
  as a new pytree laid out like the one given to restore.
"""

from __future__ import annotations

import json
import numbers
from typing import Any

import jax
import numpy as np

from jdist.checkpoint._errors import CheckpointMismatchError
from jdist.checkpoint._leaves import PerRank, describe, key_path

__all__ = ["kind_of", "array_leaves", "json_value", "check_leaves", "not_whole"]


def _is_sampler(v) -> bool:
    return all(callable(getattr(v, a, None))
               for a in ("state_dict", "load_state_dict", "set_epoch"))


def _is_ddp(v) -> bool:
    from jdist.ddp import DistributedDataParallel, FunctionalDDP

    return isinstance(v, (DistributedDataParallel, FunctionalDDP))


def _is_json(v) -> bool:
    if v is None or isinstance(v, (bool, str)):
        return True
    if isinstance(v, numbers.Number) and not isinstance(v, (np.ndarray, jax.Array)):
        return isinstance(v, (int, float)) and not isinstance(v, np.generic)
    if isinstance(v, (list, tuple)):
        return all(_is_json(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) for k in v) and all(_is_json(x) for x in v.values())
    return False


def kind_of(name: str, value: Any) -> str:
    """The kind of a state value (see the module docstring)."""
    from flax import nnx

    if _is_ddp(value):
        return "ddp"
    if isinstance(value, nnx.Rngs):
        return "rngs"
    if isinstance(value, nnx.Pytree):
        return "nnx"
    if isinstance(value, np.random.Generator):
        return "np_rng"
    if _is_sampler(value):
        return "sampler"
    if isinstance(value, PerRank):
        return "per_rank"
    if _is_json(value):
        return "json"
    leaves = jax.tree.leaves(value)
    if leaves and all(isinstance(x, (jax.Array, np.ndarray, np.generic, int, float))
                      for x in leaves):
        return "tree"
    bad = next((x for x in leaves if not isinstance(x, (jax.Array, np.ndarray, np.generic,
                                                          int, float))), value)
    raise TypeError(
        f"state[{name!r}] holds a {type(bad).__name__} that jdist.checkpoint cannot save; "
        "a state value must be an NNX module/optimizer/Rngs, a DDP wrapper, a sampler, a "
        "numpy Generator, a pytree of arrays, PerRank(pytree) or JSON-able data")


def _nnx_pure(node) -> Any:
    from flax import nnx

    return nnx.state(node).to_pure_dict()


_FUNCTIONAL = ("params", "buffers", "opt_state")


def _ddp_tree(ddp) -> dict:
    """What a DDP wrapper holds: its NNX module's state, or FunctionalDDP's pytrees."""
    module = getattr(ddp, "module", None)
    if module is not None:
        return {"module": _nnx_pure(module)}
    return {k: getattr(ddp, k) for k in _FUNCTIONAL if getattr(ddp, k, None) is not None}


def array_leaves(kind: str, value: Any) -> list[tuple[str, Any]]:
    """``[(path, leaf), ...]`` of the arrays an item saves (hook state excluded)."""
    if kind in ("nnx", "rngs"):
        tree = _nnx_pure(value)
    elif kind == "ddp":
        tree = _ddp_tree(value)
    elif kind == "per_rank":
        tree = value.tree
    elif kind == "tree":
        tree = value
    else:
        return []
    return [(key_path(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def hook_leaves(ddp) -> list[tuple[str, Any]]:
    """``[(path, stacked per-replica leaf), ...]`` of a DDP's comm-hook state."""
    state = ddp.replica_hook_state
    if state is None:
        return []
    return [(key_path(p), x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]]


_OWN = {"sampler": "a sampler (its position)", "np_rng": "a numpy Generator",
        "rngs": "an nnx.Rngs", "per_rank": "a PerRank value"}


def not_whole(name: str, kind: str, leaves: list) -> str | None:
    """Why one rank cannot save ``state[name]`` whole by itself (None: it can, every
    value being replicated, addressable here or JSON data)."""
    if kind in _OWN:
        return f"state[{name!r}] is {_OWN[kind]}, which every rank holds its own of"
    for path, x in leaves:
        if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
            return (f"state[{name!r}] {path!r} (shape {tuple(x.shape)}) is sharded over "
                    f"the devices of several processes ({str(x.sharding)[:160]})")
    return None


def rebuild(kind: str, value: Any, new_leaves: list) -> Any:
    """Write restored leaves back: in place for NNX nodes and DDP modules, else a new
    pytree shaped like ``value``."""
    from flax import nnx

    if kind == "ddp" and getattr(value, "module", None) is None:  # FunctionalDDP
        tree = jax.tree.unflatten(jax.tree.structure(_ddp_tree(value)), new_leaves)
        for k, v in tree.items():
            setattr(value, k, v)
        return value
    if kind in ("nnx", "rngs", "ddp"):
        node = value.module if kind == "ddp" else value
        state = nnx.state(node)
        pure = state.to_pure_dict()
        pure = jax.tree.unflatten(jax.tree.structure(pure), new_leaves)
        nnx.replace_by_pure_dict(state, pure)
        nnx.update(node, state)
        return value
    tree = value.tree if kind == "per_rank" else value
    return jax.tree.unflatten(jax.tree.structure(tree), new_leaves)


def json_value(kind: str, value: Any) -> Any:
    """What a JSON-kind item saves (this rank's)."""
    if kind == "sampler":
        return value.state_dict()
    if kind == "np_rng":
        return value.bit_generator.state
    if kind == "json":
        return value
    return None


def check_json(name: str, saved: Any) -> None:
    try:
        json.dumps(saved)
    except (TypeError, ValueError) as e:
        raise TypeError(f"state[{name!r}] is not JSON-able ({e}); wrap arrays in a pytree "
                        "value instead") from None


def _fmt(info: dict) -> str:
    shape = tuple(info["shape"])
    return f"shape {shape} dtype {info['dtype']}" + (
        f" (PRNG key {info['key_impl']})" if info.get("key_impl") else "")


def check_leaves(name: str, saved: list[dict], leaves: list[tuple[str, Any]],
                 resizable=lambda path, got, want: False) -> None:
    """Raise :class:`CheckpointMismatchError` naming the first path where the saved
    leaves and the restore target differ (in name, shape or dtype)."""
    where = f"state[{name!r}]"
    for i in range(max(len(saved), len(leaves))):
        s = saved[i] if i < len(saved) else None
        t = leaves[i] if i < len(leaves) else None
        if s is None:
            raise CheckpointMismatchError(
                f"{where}: the restore target has {t[0]!r} ({_fmt(describe(t[1]))}) that the "
                f"checkpoint does not have (it has {len(saved)} arrays, the target "
                f"{len(leaves)}); build the same model/optimizer as the saving run")
        if t is None:
            raise CheckpointMismatchError(
                f"{where}: the checkpoint has {s['path']!r} ({_fmt(s)}) that the restore "
                f"target does not have (it has {len(saved)} arrays, the target "
                f"{len(leaves)}); build the same model/optimizer as the saving run")
        info = describe(t[1])
        if s["path"] != t[0]:
            raise CheckpointMismatchError(
                f"{where}: the first differing path: the checkpoint has {s['path']!r} "
                f"({_fmt(s)}) where the restore target has {t[0]!r} ({_fmt(info)}); "
                "build the same model/optimizer as the saving run")
        if s["dtype"] != info["dtype"] or bool(s.get("key_impl")) != bool(
                info["key_impl"]):
            raise CheckpointMismatchError(
                f"{where}: {s['path']!r} was saved with {_fmt(s)}, the restore target has "
                f"{_fmt(info)}")
        if list(s["shape"]) != list(info["shape"]) and not resizable(
                s["path"], s, info):
            raise CheckpointMismatchError(
                f"{where}: {s['path']!r} was saved with shape {tuple(s['shape'])}, the "
                f"restore target has shape {tuple(info['shape'])}; build the same "
                "model/optimizer as the saving run")
