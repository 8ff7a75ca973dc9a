"""Distributed autograd internals (public names: :mod:`jdist.rpc.dist_autograd`).

``_context`` (contexts, ids, the thread's current context; no jax: the RPC agent
imports it), ``_params`` (what counts as a parameter), ``_engine`` (differentiable
RPCs and the backward pass), ``_gradients`` (``get_gradients``' mapping),
``_ddp_stage`` (a DDP-wrapped module as one differentiable stage).
"""
