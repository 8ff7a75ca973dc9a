"""torch's parameter groups for an optax optimizer: ``ParamGroups``.

torch builds one optimizer over several groups of parameters, each with its own
hyperparameters (``[{"params": weights, "weight_decay": 0.0}, {"params": biases}]``),
reads and sets them through ``optimizer.param_groups``, saves them in
``state_dict()["param_groups"]`` and grows the optimizer with ``add_param_group``.

``ParamGroups(optimizer, groups, **defaults)`` is that, as an optax transformation:

- ``optimizer`` is an optax factory (``optax.adamw``, ``optax.sgd``); each group runs
  ``optax.inject_hyperparams(optimizer)(**{**defaults, **group})``, so a group's numeric
  hyperparameters live in the optimizer *state* (saved and loaded with it, as torch's
  ``param_groups`` are) and may be schedules (``learning_rate=optax.exponential_decay(...)``,
  torch's ``lr_scheduler``);
- the parameters are a sequence with one pytree per group (``params[i]`` is group
  ``i``'s tree), and the state is :class:`ParamGroupsState`, one inner state per group;
- :meth:`ParamGroups.add_param_group` returns the transformation with one more group,
  and :meth:`ParamGroups.extend_state` the state with that group's fresh state appended
  (the other groups' states are untouched, as in torch);
- :func:`param_groups` reads the hyperparameters back from a state.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import jax
import numpy as np
import optax

__all__ = ["ParamGroups", "ParamGroupsState", "check_param_group", "groups_of", "param_groups",
           "set_hyperparams"]


class ParamGroupsState(NamedTuple):
    """One inner (``inject_hyperparams``) state per parameter group, in group order."""

    groups: tuple


def _scalar(x):
    """A Python number from a scalar (numpy, local or replicated global array)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return np.asarray(x).item()


def _hyperparam_nodes(state) -> list:
    """The ``inject_hyperparams`` states inside ``state``, in tree order."""
    found: list = []

    def visit(node):
        if hasattr(node, "hyperparams") and isinstance(node.hyperparams, Mapping):
            found.append(node)
            return
        if isinstance(node, (str, bytes)) or not isinstance(node, (tuple, list, Mapping)):
            return
        for child in (node.values() if isinstance(node, Mapping) else node):
            visit(child)

    visit(state)
    return found


def param_groups(state) -> list[dict]:
    """The numeric hyperparameters of every ``inject_hyperparams`` state in ``state``.

    One dict per group (per ``inject_hyperparams`` state, in tree order), values as
    Python numbers: what torch's ``optimizer.param_groups`` shows, minus ``"params"``.
    A transformation built without ``inject_hyperparams`` keeps its hyperparameters in
    Python closures, out of the state: it has no groups to show (``[]``).
    """
    return [{k: _scalar(v) for k, v in node.hyperparams.items()}
            for node in _hyperparam_nodes(state)]


def set_hyperparams(state, group: int, **values):
    """``state`` with group ``group``'s numeric hyperparameters set (torch's
    ``optimizer.param_groups[group]["lr"] = ...``, as a manual scheduler does).

    ``group`` counts the ``inject_hyperparams`` states in tree order (the order of
    :func:`param_groups`); each value keeps the stored dtype and placement. A name the
    group does not hold in its state raises ``KeyError`` listing those it holds (a
    schedule's value is recomputed every step: change the schedule instead).
    """
    nodes = _hyperparam_nodes(state)
    if not 0 <= group < len(nodes):
        raise IndexError(f"group {group} is out of range: the state holds {len(nodes)} "
                         "inject_hyperparams states")
    target = nodes[group]
    missing = sorted(set(values) - set(target.hyperparams))
    if missing:
        raise KeyError(f"group {group} holds no hyperparameter {missing} in its state; it "
                       f"holds {sorted(target.hyperparams)}")

    def placed(old, value):
        new = np.asarray(value, dtype=old.dtype)
        return jax.device_put(new, old.sharding) if isinstance(old, jax.Array) else new

    hyper = {k: placed(v, values[k]) if k in values else v
             for k, v in target.hyperparams.items()}
    return _replace_node(state, target, target._replace(hyperparams=hyper))


def _replace_node(node, old, new):
    """``node`` with the object ``old`` inside it replaced by ``new`` (containers rebuilt)."""
    if node is old:
        return new
    if isinstance(node, Mapping):
        return type(node)({k: _replace_node(v, old, new) for k, v in node.items()})
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return type(node)(*(_replace_node(v, old, new) for v in node))
    if isinstance(node, (tuple, list)):
        return type(node)(_replace_node(v, old, new) for v in node)
    return node


class ParamGroups:
    """An optax optimizer over torch-style parameter groups (module docstring).

    Args:
      optimizer: an optax factory taking the hyperparameters as keywords
        (``optax.adamw``).
      groups: one dict of hyperparameter overrides per group (default: one group with
        the defaults). A ``"params"`` entry is refused: the parameters go to ``init``.
      **defaults: hyperparameters every group starts from (``learning_rate=1e-3``).

    Example::

      tx = ParamGroups(optax.adamw, [{"weight_decay": 0.0}, {"weight_decay": 0.01}],
                       learning_rate=1e-2)
      state = tx.init([weights, biases])          # params[i] is group i's pytree
    """

    def __init__(self, optimizer: Callable, groups: Sequence[Mapping] = ({},), **defaults):
        if not callable(optimizer):
            raise TypeError(f"ParamGroups needs an optax factory such as optax.adamw, got "
                            f"{type(optimizer).__name__} {optimizer!r}")
        self.optimizer = optimizer
        self._names = _keywords(optimizer)
        self.defaults = self._checked(defaults, "defaults")
        if isinstance(groups, Mapping) or not len(groups):
            raise ValueError("ParamGroups(groups=...) takes a non-empty list of dicts of "
                             f"hyperparameters, one per group; got {groups!r}")
        self.groups = tuple(self._checked(g, f"group {i}") for i, g in enumerate(groups))
        self._txs = tuple(optax.inject_hyperparams(optimizer)(**{**self.defaults, **g})
                          for g in self.groups)

    def _checked(self, hparams: Mapping, what: str) -> dict:
        if not isinstance(hparams, Mapping):
            raise TypeError(f"ParamGroups: {what} must be a dict of hyperparameters, got "
                            f"{type(hparams).__name__} {hparams!r}")
        if "params" in hparams:
            raise ValueError(f"ParamGroups: {what} has a 'params' entry; jdist "
                             "optimizers take the parameters in init(params), one pytree "
                             "per group: ParamGroups(opt, [{...}, {...}]).init([p0, p1])")
        unknown = sorted(set(hparams) - set(self._names)) if self._names else []
        if unknown:
            raise TypeError(f"ParamGroups: {what} sets {unknown}, which "
                            f"{_name(self.optimizer)} does not take; its hyperparameters: "
                            f"{sorted(self._names)}")
        return dict(hparams)

    def transformation(self, index: int):
        """The optax transformation of group ``index``."""
        return self._txs[index]

    def add_param_group(self, hparams: Mapping | None = None) -> ParamGroups:
        """This transformation with one more group (``hparams`` over the defaults).

        torch's ``add_param_group`` (which mutates); the state grows with
        :meth:`extend_state`, the parameters with one more pytree.
        """
        return ParamGroups(self.optimizer, self.groups + (dict(hparams or {}),),
                           **self.defaults)

    def extend_state(self, state: ParamGroupsState, group_params) -> ParamGroupsState:
        """``state`` with the fresh state of the last group appended (its parameters)."""
        need = len(self.groups) - 1
        if not isinstance(state, ParamGroupsState) or len(state.groups) != need:
            raise ValueError(f"extend_state needs this transformation's state before its "
                             f"last group was added ({need} groups), got {_count(state)}")
        return ParamGroupsState(state.groups + (self._txs[-1].init(group_params),))

    def _check_params(self, params, what: str) -> None:
        if not isinstance(params, (list, tuple)) or len(params) != len(self.groups):
            got = (f"a {type(params).__name__} of {len(params)}"
                   if isinstance(params, (list, tuple)) else type(params).__name__)
            raise ValueError(
                f"ParamGroups.{what} takes a list with one pytree per group "
                f"({len(self.groups)} groups), got {got}; pass [group0_params, ...]")

    def init(self, params) -> ParamGroupsState:
        self._check_params(params, "init")
        return ParamGroupsState(tuple(tx.init(p) for tx, p in
                                      zip(self._txs, params, strict=True)))

    def update(self, updates, state: ParamGroupsState, params=None, **extra):
        self._check_params(updates, "update")
        if not isinstance(state, ParamGroupsState) or len(state.groups) != len(self.groups):
            raise ValueError(f"ParamGroups.update got {_count(state)}; expected the state "
                             f"of this transformation's init ({len(self.groups)} groups)")
        ps = [None] * len(self.groups) if params is None else params
        outs = [optax.with_extra_args_support(tx).update(u, s, p, **extra)
                for tx, u, s, p in zip(self._txs, updates, state.groups, ps, strict=True)]
        return (type(updates)(u for u, _ in outs),
                ParamGroupsState(tuple(s for _, s in outs)))

    def param_groups(self, state: ParamGroupsState) -> list[dict]:
        """torch's ``optimizer.param_groups`` (without ``"params"``): per group, its
        settings with the numeric hyperparameters read from ``state``."""
        if not isinstance(state, ParamGroupsState):
            raise TypeError(f"param_groups needs a ParamGroupsState, got {_count(state)}")
        out = []
        for i, inner in enumerate(state.groups):
            group = {**_signature_defaults(self.optimizer), **self.defaults, **self.groups[i]}
            out.append({**{k: v for k, v in group.items() if not callable(v)},
                        **param_groups(inner)[0]})
        return out


def groups_of(tx, state) -> list[dict]:
    """``tx.param_groups(state)`` for a :class:`ParamGroups`, else :func:`param_groups`."""
    if isinstance(tx, ParamGroups) and isinstance(state, ParamGroupsState):
        return tx.param_groups(state)
    return param_groups(state)


def check_param_group(tx, param_group, what: str) -> None:
    """torch's ``add_param_group`` argument checks, for a wrapper of ``tx``."""
    if not isinstance(tx, ParamGroups):
        raise TypeError(
            "add_param_group needs parameter groups: build the optimizer around "
            f"jdist.optim.ParamGroups(optax.adamw, [...], ...); this one wraps {what}")
    if not isinstance(param_group, Mapping) or "params" not in param_group:
        raise ValueError(f"param_group must be a dict with a 'params' entry, got "
                         f"{param_group!r}")


def _signature_defaults(fn) -> dict:
    """The factory's own defaults (torch shows every setting in ``param_groups``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in params if p.default is not p.empty}


def _keywords(fn) -> tuple:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return ()
    return tuple(p.name for p in params)


def _name(fn) -> str:
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)}".lstrip(".")


def _count(state) -> str:
    if isinstance(state, ParamGroupsState):
        return f"a ParamGroupsState of {len(state.groups)} groups"
    return type(state).__name__
