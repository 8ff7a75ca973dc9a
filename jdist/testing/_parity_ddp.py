"""The parity harness under data parallelism: torch DDP vs jdist DDP on N processes each.

:func:`~jdist.testing.run_parity` with ``nprocs > 1`` comes here. Each framework runs in
its own ``nprocs`` fresh processes (:func:`jdist.launch.spawn`): first torch
(``torch.distributed`` over gloo, ``torch.nn.parallel.DistributedDataParallel``), then
JAX (``jdist.init_process_group()``, :class:`jdist.ddp.DistributedDataParallel` with
``train_step``). Every process trains on its :class:`~jdist.sampler.DistributedSampler`
share of each step (torch's sampler in the torch processes, jdist's in the JAX ones,
checked index for index). Both DDPs broadcast process 0's parameters at wrap time and
its buffers before every forward, and average gradients, so process 0 of each framework
ends with the model every process holds.

The JAX processes start from the weights torch's process 0 had after wrapping (sent to
them), so the model factories need not be deterministic. Reported per-step losses are
the means over processes; parameters are process 0's, compared in the calling process.
"""

from __future__ import annotations

import gc
import os
import pickle

import jax
import numpy as np
from flax import nnx

from jdist.testing import _convert
from jdist.testing._parity_case import (
    Case,
    as_jax,
    as_torch,
    batch_schedule,
    check_models,
    input_transform,
    jax_schedule,
    set_train,
)
from jdist.testing._parity_pairs import make_optax, make_torch_optimizer
from jdist.testing._parity_report import ParityReport, StepResult, compare_models

__all__ = ["run_ddp_parity"]


def _env_rank() -> tuple[int, int]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _torch_state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def _load_torch_state(model, state: dict[str, np.ndarray]) -> None:
    import torch

    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()})


def _nnx_state(model) -> dict:
    state = nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat))
    return jax.tree.map(lambda a: np.asarray(a).copy(), nnx.to_pure_dict(state))


def _load_nnx_state(model, pure: dict) -> None:
    state = nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat))
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)


def _torch_worker(cases: list[Case], timeout: float) -> list[dict]:
    """One torch DDP process: each case's losses, indices and (process 0) snapshots."""
    from datetime import timedelta

    import torch.distributed as dist

    rank, world = _env_rank()
    dist.init_process_group(
        "gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    try:
        out = [_torch_case(c, rank, world) for c in cases]
        # torch's DDP reducers sit in reference cycles: collect them while the group is
        # alive (a reducer outliving destroy_process_group() has aborted torch at exit:
        # "terminate called without an active exception")
        gc.collect()
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


def _torch_case(c: Case, rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    model = c.torch_model()
    model.train(c.train)
    ddp = DistributedDataParallel(model)  # broadcasts process 0's parameters and buffers
    init = _torch_state(model) if rank == 0 else None
    opt = make_torch_optimizer(c.spec, ddp.parameters())
    x, y = c.data
    idx = batch_schedule(len(x), c.steps, c.batch_size, num_replicas=world, rank=rank,
                           source="torch", **c.schedule)
    losses, snaps = [], []
    for b in idx:
        opt.zero_grad(set_to_none=True)
        loss = c.loss.torch_fn(ddp(as_torch(x[b])), as_torch(y[b]))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if rank == 0 and (c.every_step or len(losses) == c.steps):
            snaps.append(_torch_state(model))
    return {"losses": losses, "indices": idx, "init": init, "snaps": snaps}


def _jax_worker(cases: list[Case], torch_out: list[list[dict]]) -> list[dict]:
    """One jdist DDP process; ``torch_out[rank][case]`` is what the torch run gave."""
    import jdist

    jdist.init_process_group()
    try:
        rank, world = jdist.get_rank(), jdist.get_world_size()
        out = [_jax_case(c, rank, world, torch_out[0][i]["init"],
                         torch_out[rank][i]["indices"]) for i, c in enumerate(cases)]
        jdist.barrier()
        return out
    finally:
        jdist.destroy_process_group()


def _jax_case(c: Case, rank: int, world: int, torch_init, torch_indices) -> dict:
    from jdist.ddp import DistributedDataParallel

    nnx_model = c.nnx_model()
    if c.copy_weights:  # from the weights torch's process 0 had after wrapping
        torch_model = c.torch_model()
        _load_torch_state(torch_model, torch_init)
        _convert.torch_to_nnx(torch_model, nnx_model, strict=c.strict,
                              check_config=c.check_config)
    set_train(None, nnx_model, c.train)
    ddp = DistributedDataParallel(nnx_model)
    opt = nnx.Optimizer(nnx_model, make_optax(c.spec), wrt=nnx.Param)
    jax_fn, transform = c.loss.jax_fn, input_transform(c.jax_input)
    step = ddp.train_step(lambda m, batch: jax_fn(m(batch[0]), batch[1]), opt)
    x, y = c.data
    config: dict = {"sampler": ""}
    idx = jax_schedule(len(x), c.steps, c.batch_size, torch_indices, c.schedule, config,
                          num_replicas=world, rank=rank)
    losses, snaps = [], []
    for b in idx:
        batch = (np.asarray(as_jax(transform(x[b]))), np.asarray(as_jax(y[b])))
        losses.append(float(jax.block_until_ready(step(batch))))
        if rank == 0 and (c.every_step or len(losses) == c.steps):
            snaps.append(_nnx_state(ddp.module))
    return {"losses": losses, "snaps": snaps, "sampler": config["sampler"]}


def _check_factory(f, what: str, i: int) -> None:
    import torch

    if not callable(f) or isinstance(f, (torch.nn.Module, nnx.Module)):
        raise TypeError(f"case #{i}: with nprocs > 1, {what} must be a picklable function "
                        f"that builds the model in each process (e.g. "
                        f"functools.partial(build, ...)), got {type(f).__name__}")


def _check_picklable(c: Case, i: int) -> None:
    for what, v in (("torch_model", c.torch_model), ("nnx_model", c.nnx_model),
                    ("loss", c.loss), ("jax_input", c.jax_input)):
        try:
            pickle.dumps(v)
        except Exception as e:
            raise TypeError(f"case #{i}: with nprocs > 1, {what} must be picklable "
                            f"(module-level functions or functools.partial of them), got "
                            f"{v!r}: {e}") from e


def run_ddp_parity(cases: list[Case], *, nprocs: int, timeout: float,
                   start_method: str = "spawn") -> list[ParityReport]:
    """:func:`~jdist.testing.run_parity_cases` for ``nprocs > 1`` (see the module doc)."""
    from jdist.launch import spawn

    refs = []
    for i, c in enumerate(cases):
        _check_factory(c.torch_model, "torch_model", i)
        _check_factory(c.nnx_model, "nnx_model", i)
        _check_picklable(c, i)
        t_ref, n_ref = c.torch_model(), c.nnx_model()
        check_models(t_ref, n_ref)
        compare_models(t_ref, n_ref, strict=c.strict)  # pairing errors before launching
        refs.append((t_ref, n_ref))
    tres = spawn(_torch_worker, args=(cases, float(timeout)), nprocs=nprocs, timeout=timeout,
                 start_method=start_method)
    jres = spawn(_jax_worker, args=(cases, tres), nprocs=nprocs, timeout=timeout,
                 start_method=start_method)
    return [_report(c, [r[i] for r in tres], [r[i] for r in jres], *refs[i], nprocs)
            for i, c in enumerate(cases)]


def _report(c: Case, tres: list[dict], jres: list[dict], t_ref, n_ref,
            nprocs: int) -> ParityReport:
    steps = tuple(
        StepResult(k, float(np.mean([r["losses"][k] for r in tres])),
                     float(np.mean([r["losses"][k] for r in jres])))
        for k in range(c.steps))
    per_step = []
    for ts, js in zip(tres[0]["snaps"], jres[0]["snaps"], strict=True):
        _load_torch_state(t_ref, ts)
        _load_nnx_state(n_ref, js)
        per_step.append(compare_models(t_ref, n_ref, strict=c.strict))
    config = dict(c.config, sampler=c.config["sampler"] + jres[0]["sampler"],
                  nprocs=f"{nprocs} (torch DDP over gloo vs jdist DDP)")
    return ParityReport(steps, per_step[-1], tuple(per_step) if c.every_step else None,
                          config)
