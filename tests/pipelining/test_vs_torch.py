"""jdist's pipeline schedules against torch's ``torch.distributed.pipelining`` from the
same weights and data: per-micro-batch losses, the merged output and every stage's
gradients (1e-5). Four stages in one process (torch on its ``fake`` process group, as
its own ``test_schedule.py`` runs single-process schedules), for every schedule that
can hold several stages per rank, and a single stage for every schedule (torch's
``test_schedule_with_single_stage``)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jdist.pipelining as pp

torch = pytest.importorskip("torch")
tpp = pytest.importorskip("torch.distributed.pipelining")
fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")

D, BATCH = 6, 12


@pytest.fixture
def torch_group():
    import torch.distributed as dist

    dist.init_process_group(backend="fake", rank=0, world_size=1, store=fake_pg.FakeStore())
    yield
    dist.destroy_process_group()


def _pair(n_stages: int, seed: int):
    torch.manual_seed(seed)
    tmods = [torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh())
             for _ in range(n_stages)]
    jmods = []
    for t in tmods:
        lin = nnx.Linear(D, D, rngs=nnx.Rngs(0))
        lin.kernel.value = jnp.asarray(t[0].weight.detach().numpy().T)
        lin.bias.value = jnp.asarray(t[0].bias.detach().numpy())
        jmods.append(nnx.Sequential(lin, jnp.tanh))
    return tmods, jmods


def _mse(out, target):
    return jnp.mean((out - target) ** 2)


def _compare(name, n_stages, m, seed):
    tmods, jmods = _pair(n_stages, seed)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, D)).astype(np.float32)
    y = rng.standard_normal((BATCH, D)).astype(np.float32)
    tstages = [tpp.PipelineStage(t, i, n_stages, torch.device("cpu"))
               for i, t in enumerate(tmods)]
    tcls = getattr(tpp, "Schedule" + name)
    single = issubclass(tcls, tpp.schedules.PipelineScheduleSingle)
    tsched = tcls(tstages[0] if single else tstages, m,
                  loss_fn=torch.nn.functional.mse_loss)
    tlosses: list = []
    tout = tsched.step(torch.from_numpy(x), target=torch.from_numpy(y), losses=tlosses)
    jstages = [pp.PipelineStage(j, i, n_stages) for i, j in enumerate(jmods)]
    jsched = pp.get_schedule_class(name)(jstages, m, loss_fn=_mse)
    jlosses: list = []
    jout = jsched.step(x, target=y, losses=jlosses)
    np.testing.assert_allclose([float(v) for v in jlosses],
                               [float(v.detach()) for v in tlosses], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jout, tout.detach().numpy(), rtol=1e-5, atol=1e-6)
    for t, st in zip(tmods, jstages, strict=True):
        g = st.grads["layers"][0]
        np.testing.assert_allclose(g["kernel"].value, t[0].weight.grad.numpy().T,
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g["bias"].value, t[0].bias.grad.numpy(), rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("name", ["LoopedBFS", "Interleaved1F1B", "InterleavedZeroBubble"])
@pytest.mark.parametrize("m", [4, 6])
def test_four_local_stages_match_torch(torch_group, name, m):
    _compare(name, 4, m, seed=m)


@pytest.mark.parametrize("name", ["GPipe", "1F1B", "LoopedBFS", "Interleaved1F1B",
                                  "InterleavedZeroBubble"])
def test_single_stage_matches_torch(torch_group, name):
    _compare(name, 1, 2, seed=1)


@pytest.mark.parametrize("name", ["GPipe", "1F1B", "LoopedBFS", "Interleaved1F1B",
                                  "InterleavedZeroBubble"])
def test_eval_then_train(name):
    """torch's test_schedule_eval_then_train: evaluation steps before training steps
    leave no state behind (the training step equals one on a fresh schedule)."""
    _, jmods = _pair(1, 3)
    _, fresh = _pair(1, 3)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((BATCH, D)).astype(np.float32)
    y = rng.standard_normal((BATCH, D)).astype(np.float32)
    used = pp.get_schedule_class(name)([pp.PipelineStage(jmods[0], 0, 1)], 2, loss_fn=_mse)
    for _ in range(2):
        losses: list = []
        used.eval(x, target=y, losses=losses)
        assert len(losses) == 2
    clean = pp.get_schedule_class(name)([pp.PipelineStage(fresh[0], 0, 1)], 2, loss_fn=_mse)
    a, b = used.step(x, target=y), clean.step(x, target=y)
    np.testing.assert_array_equal(a, b)
    for u, c in zip(used._stages, clean._stages, strict=True):
        np.testing.assert_array_equal(u.grads["layers"][0]["kernel"].value,
                                      c.grads["layers"][0]["kernel"].value)
