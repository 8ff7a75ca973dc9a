"""Random RPC call graphs under distributed autograd, run by torch's rpc and by jdist's.

A case is a JSON tree evaluated on worker 0 of a 3-worker job:

- ``{"op": "param", "id": i}``: parameter ``i`` (a vector), owned by worker
  ``owners[i]``; it appears only where the tree runs on its owner (read there through
  its RRef's ``local_value()``, so every worker holds parameters of its own);
- ``{"op": "local", "fn": f, "args": [...]}``: ``f`` applied where the tree runs;
- ``{"op": "call", "on": k, "how": "sync"|"async"|"remote", "fn": f, "args": [...],
  "inner": [...]}``: the caller evaluates ``args`` (which may call other workers), sends
  their values to worker ``k`` by ``rpc_sync``, ``rpc_async(...).wait()`` or
  ``remote(...).to_here()``, or (``"handoff"``) makes the ``remote()`` and hands its
  RRef to worker ``via``, which calls ``to_here()`` and returns the value; worker
  ``k`` evaluates ``inner`` there (nested RPCs from ``k``, its own parameters) and
  returns ``f(*args, *inner)``. RRefs of every
  parameter travel with each call, so any worker can hand them on.

The loss is the sum of the root's value; after the backward pass each parameter's owner
reports its gradient from its own context (``get_gradients``). Both frameworks run the
same tree from the same values; the test compares the loss and every gradient.
"""

from __future__ import annotations

import numpy as np

N = 3  # every value is a vector of N float32
WORKERS = 3
ARITY = {"tanh": 1, "sin": 1, "scale": 1, "square": 1, "mul": 2, "add": 2, "sub": 2}


def _apply(xp, fn: str, vals: list):
    a = vals[0]
    if fn == "tanh":
        return xp.tanh(a)
    if fn == "sin":
        return xp.sin(a)
    if fn == "scale":
        return a * 1.5
    if fn == "square":
        return a * a
    b = vals[1]
    return {"mul": lambda: a * b, "add": lambda: a + b, "sub": lambda: a - b}[fn]()


def param_values(case: dict) -> list:
    rng = np.random.default_rng(case["seed"])
    return [rng.uniform(-1.0, 1.0, N).astype(np.float32) for _ in case["owners"]]


# ------------------------------------------------------------------ torch


def _torch_make_param(values):
    import torch

    return torch.tensor(values, requires_grad=True)


def _torch_eval(node, rrefs):
    import torch
    import torch.distributed.rpc as rpc

    op = node["op"]
    if op == "param":
        return rrefs[node["id"]].local_value()
    if op == "local":
        return _apply(torch, node["fn"], [_torch_eval(a, rrefs) for a in node["args"]])
    args = tuple(_torch_eval(a, rrefs) for a in node["args"])
    to, call = f"w{node['on']}", (node, args, rrefs)
    if node["how"] == "sync":
        return rpc.rpc_sync(to, _torch_callee, call)
    if node["how"] == "async":
        return rpc.rpc_async(to, _torch_callee, call).wait()
    rref = rpc.remote(to, _torch_callee, call)
    if node["how"] == "handoff":
        return rpc.rpc_sync(f"w{node['via']}", _torch_to_here, (rref,))
    return rref.to_here()


def _torch_to_here(rref):
    return rref.to_here()


def _torch_callee(node, args, rrefs):
    import torch

    inner = [_torch_eval(a, rrefs) for a in node["inner"]]
    return _apply(torch, node["fn"], [*args, *inner])


def _torch_grad(cid, rref):
    import torch.distributed.autograd as dist_autograd

    return dist_autograd.get_gradients(cid)[rref.local_value()].tolist()


def torch_case(case: dict):
    """On every worker of a torch rpc job: worker 0 runs ``case``, the others serve."""
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc

    if rpc.get_worker_info().id != 0:
        return None
    rrefs = [rpc.remote(f"w{k}", _torch_make_param, (v.tolist(),))
             for k, v in zip(case["owners"], param_values(case), strict=True)]
    with dist_autograd.context() as cid:
        loss = _torch_eval(case["tree"], rrefs).sum()
        dist_autograd.backward(cid, [loss])
        grads = [rpc.rpc_sync(f"w{k}", _torch_grad, (cid, r))
                 for k, r in zip(case["owners"], rrefs, strict=True)]
    return {"loss": float(loss), "grads": grads}


# ------------------------------------------------------------------ jdist


def _jdist_make_param(values):
    import jax.numpy as jnp
    from flax import nnx

    return nnx.Param(jnp.asarray(values, jnp.float32))


def _jdist_eval(node, rrefs):
    import jax.numpy as jnp

    from jdist import rpc

    op = node["op"]
    if op == "param":
        return rrefs[node["id"]].local_value()[...]
    if op == "local":
        return _apply(jnp, node["fn"], [_jdist_eval(a, rrefs) for a in node["args"]])
    args = tuple(_jdist_eval(a, rrefs) for a in node["args"])
    to, call = f"w{node['on']}", (node, args, rrefs)
    if node["how"] == "sync":
        return rpc.rpc_sync(to, _jdist_callee, call)
    if node["how"] == "async":
        return rpc.rpc_async(to, _jdist_callee, call).wait()
    rref = rpc.remote(to, _jdist_callee, call)
    if node["how"] == "handoff":
        return rpc.rpc_sync(f"w{node['via']}", _jdist_to_here, (rref,))
    return rref.to_here()


def _jdist_to_here(rref):
    return rref.to_here()


def _jdist_callee(node, args, rrefs):
    import jax.numpy as jnp

    inner = [_jdist_eval(a, rrefs) for a in node["inner"]]
    return _apply(jnp, node["fn"], [*args, *inner])


def _jdist_grad(cid, rref):
    import numpy as np

    from jdist.rpc import dist_autograd

    return np.asarray(dist_autograd.get_gradients(cid)[rref.local_value()]).tolist()


def jdist_case(case: dict):
    """On every worker of a jdist rpc job: worker 0 runs ``case``, the others serve."""
    import jax.numpy as jnp

    from jdist import rpc
    from jdist.rpc import dist_autograd

    if rpc.get_worker_info().id != 0:
        return None
    rrefs = [rpc.remote(f"w{k}", _jdist_make_param, (v.tolist(),))
             for k, v in zip(case["owners"], param_values(case), strict=True)]
    with dist_autograd.context() as cid:
        # the caller's parameters are arguments of the loss function (JAX has no tape)
        loss = dist_autograd.backward(
            cid, lambda rs: jnp.sum(_jdist_eval(case["tree"], rs)), rrefs)
        grads = [rpc.rpc_sync(f"w{k}", _jdist_grad, (cid, r))
                 for k, r in zip(case["owners"], rrefs, strict=True)]
    return {"loss": float(loss), "grads": grads}


# ------------------------------------------------------------------ no RPC at all


def reference(case: dict) -> dict:
    """The same tree in one process, differentiated by ``jax.grad`` (float64)."""
    import jax
    import jax.numpy as jnp

    def value(node, ps):
        if node["op"] == "param":
            return ps[node["id"]]
        vals = [value(a, ps) for a in node["args"] + node.get("inner", [])]
        return _apply(jnp, node["fn"], vals)

    with jax.enable_x64(True):
        ps = [jnp.asarray(v, jnp.float64) for v in param_values(case)]
        loss, grads = jax.value_and_grad(lambda p: jnp.sum(value(case["tree"], p)))(ps)
        return {"loss": float(loss), "grads": [np.asarray(g).tolist() for g in grads]}


# ------------------------------------------------------------------ cases


def build_tree(draw_choice, depth: int, where: int, owners: list) -> dict:
    """A random tree evaluated on worker ``where``; ``draw_choice(options)`` picks one.
    New parameters (owned by the worker they appear on) are appended to ``owners``."""
    leaf_kinds = ["new_param"] + (["reuse"] if any(o == where for o in owners) else [])
    kind = draw_choice(["leaf", "local", "call"] if depth > 0 else ["leaf"])
    if kind == "leaf":
        mine = [i for i, o in enumerate(owners) if o == where]
        if draw_choice(leaf_kinds) == "reuse":
            return {"op": "param", "id": draw_choice(mine)}
        owners.append(where)
        return {"op": "param", "id": len(owners) - 1}
    fn = draw_choice(sorted(ARITY))
    if kind == "local":
        return {"op": "local", "fn": fn, "args": [
            build_tree(draw_choice, depth - 1, where, owners)
            for _ in range(ARITY[fn])]}
    on = draw_choice([w for w in range(WORKERS) if w != where])
    n_args = draw_choice(list(range(ARITY[fn] + 1)))  # the rest are evaluated on ``on``
    how = draw_choice(["sync", "async", "remote", "handoff"])
    extra = {"via": draw_choice([w for w in range(WORKERS) if w != on])} \
        if how == "handoff" else {}
    return {"op": "call", "on": on, "how": how, "fn": fn, **extra,
            "args": [build_tree(draw_choice, depth - 1, where, owners)
                     for _ in range(n_args)],
            "inner": [build_tree(draw_choice, depth - 1, on, owners)
                      for _ in range(ARITY[fn] - n_args)]}
