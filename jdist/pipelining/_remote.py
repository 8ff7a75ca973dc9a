"""One rank's share of a pipeline whose stages live in several processes.

Rank ``r`` of the pipeline group holds the stages ``s`` with ``s % pp == r`` and runs
its own list of the schedule's order, action after action (as torch's runtime does),
waiting for the inputs other ranks send (``jdist/pipelining/_links.py``). A forward's
output goes to the next stage (here, or sent to its rank); a backward's input gradient
goes to the previous stage. The rank of stage 0 splits the step's inputs, the rank of
the last stage the target, and only it returns the merged output and fills ``losses``.
"""

from __future__ import annotations

from typing import Any

from jdist.pipelining._actions import Action, Kind
from jdist.pipelining._links import Links

__all__ = ["plans", "run_rank", "raise_in", "average_over"]


def average_over(grads, dp_group):
    """``grads`` averaged over the pipeline replicas in ``dp_group``: one eager
    all-reduce per dtype of the leaves, packed into one vector."""
    import jax
    import numpy as np

    import jdist

    leaves, treedef = jax.tree.flatten(grads)
    out = list(leaves)
    for dtype in sorted({np.dtype(leaf.dtype).name for leaf in leaves}):
        idx = [i for i, leaf in enumerate(leaves) if np.dtype(leaf.dtype).name == dtype]
        flat = np.concatenate([np.asarray(leaves[i]).ravel() for i in idx])
        flat = np.asarray(jdist.all_reduce(flat, op=jdist.ReduceOp.AVG, group=dp_group))
        start = 0
        for i in idx:
            n = leaves[i].size
            out[i] = jax.device_put(flat[start:start + n].reshape(leaves[i].shape),
                                    next(iter(leaves[i].devices())))
            start += n
    return jax.tree.unflatten(treedef, out)


def raise_in(exc: Exception, message: str):
    """Raise ``exc``'s class with ``message`` (RuntimeError when it cannot be built)."""
    try:
        new = type(exc)(message)
    except Exception:
        new = RuntimeError(message)
    raise new from exc


def _messages(order: dict, pp: int, n_stages: int, backward: bool):
    """Every message of a step, per sending rank in its action order:
    ``{sender: [(receiver, key), ...]}``; keys ``("act", s, i)`` (stage ``s``'s input)
    and ``("grad", s, i)`` (the gradient of stage ``s``'s output)."""
    out: dict[int, list] = {r: [] for r in order}
    for r, ops in order.items():
        for a in ops:
            if a is None:
                continue
            if a.kind is Kind.FORWARD and a.stage < n_stages - 1:
                to = (a.stage + 1) % pp
                if to != r:
                    out[r].append((to, ("act", a.stage + 1, a.microbatch)))
            elif backward and a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT) and a.stage:
                to = (a.stage - 1) % pp
                if to != r:
                    out[r].append((to, ("grad", a.stage - 1, a.microbatch)))
    return out


def plans(order: dict, pp: int, n_stages: int, me: int, backward: bool):
    """``(sends, recvs)`` for rank ``me``: messages per peer it sends, and the keys it
    receives from each peer in the order that peer sends them."""
    msgs = _messages(order, pp, n_stages, backward)
    sends = {p: 0 for p in range(pp) if p != me}
    for to, _ in msgs[me]:
        sends[to] += 1
    recvs = {p: [key for to, key in msgs[p] if to == me] for p in range(pp) if p != me}
    return sends, recvs


class _Step:
    """The state of one step on this rank."""

    def __init__(self, me: int, stages: dict, links: Links, pp: int, n_stages: int, chunks,
                 targets, loss_fn, backward: bool) -> None:
        self.me, self.stages, self.links, self.pp = me, stages, links, pp
        self.last = n_stages - 1
        self.chunks, self.targets, self.loss_fn = chunks, targets, loss_fn
        self.backward = backward
        self.local: dict = {}
        self.outputs: dict[int, Any] = {}
        self.losses: dict[int, Any] = {}

    def _input(self, key: tuple, frm: int, what: str):
        if frm % self.pp == self.me:
            return self.local.pop(key)
        return self.links.get(key, what, frm % self.pp)

    def _output(self, key: tuple, to: int, x) -> None:
        if to % self.pp == self.me:
            self.local[key] = x
        elif isinstance(x, (tuple, list, dict)):
            raise ValueError(f"{key[0]} for stage {key[1]} is a {type(x).__name__} of "
                             f"{len(x)} items; stages in separate processes pass one array "
                             f"between them (return one array from the stage)")
        else:
            self.links.put(to % self.pp, x)

    def act(self, a: Action) -> None:
        st, s, i = self.stages[a.stage], a.stage, a.microbatch
        if a.kind is Kind.FORWARD:
            x = (self.chunks[i] if s == 0 else
                 self._input(("act", s, i), s - 1, f"the input of stage {s}, micro-batch {i}"))
            if s < self.last:
                self._output(("act", s + 1, i), s + 1, st.forward(i, x, with_grad=self.backward))
            elif self.backward:
                self.outputs[i], self.losses[i] = st.forward(i, x, self.targets[i])
            else:
                self.outputs[i] = st.forward(i, x, with_grad=False)
                if self.targets[i] is not None:
                    self.losses[i] = self.loss_fn(self.outputs[i], self.targets[i])
        elif a.kind is Kind.BACKWARD_WEIGHT:
            st.backward_weight(i)
        else:
            ct = None if s == self.last else self._input(
                ("grad", s, i), s + 1, f"the gradient of stage {s}'s output, micro-batch {i}")
            fn = st.backward if a.kind is Kind.BACKWARD else st.backward_input
            gxs = fn(i, ct)
            if s > 0:
                if len(gxs) != 1:
                    raise ValueError(f"stage {s} takes {len(gxs)} inputs; stages in separate "
                                     f"processes pass one array between them")
                self._output(("grad", s - 1, i), s - 1, gxs[0])


def run_rank(make_links, me: int, order: dict, stages: dict, n_stages: int, chunks,
             targets, loss_fn, backward: bool, timeout: float,
             problem: str | None = None) -> _Step:
    """Run rank ``me``'s actions; returns the step's state (outputs, losses). With a
    ``problem`` (bad arguments here), tell every peer and raise ValueError.
    ``make_links(sends, recvs)`` makes the step's :class:`Links` (or the mailbox's
    :class:`~jdist.pipelining._sockets.SocketLinks`)."""
    pp = len(order)
    sends, recvs = plans(order, pp, n_stages, me, backward)
    links = make_links(sends, recvs)
    if problem is not None:
        links.fail(f"bad step arguments: {problem}")
        links.close(5.0)
        raise ValueError(f"pipeline rank {me}: {problem}")
    step = _Step(me, stages, links, pp, n_stages, chunks, targets, loss_fn, backward)
    for a in order[me]:
        if a is None or (not backward and a.kind is not Kind.FORWARD):
            continue
        try:
            step.act(a)
        except Exception as exc:
            links.fail(f"{type(exc).__name__} in stage {a.stage}, action {a}: {exc}")
            links.close(5.0)
            raise_in(exc, f"pipeline rank {me}, stage {a.stage}, action {a} (micro-batch "
                          f"{a.microbatch}): {exc}")
    links.finish()  # (every rank's step ended well, or this one raises too)
    links.close(timeout)
    return step
