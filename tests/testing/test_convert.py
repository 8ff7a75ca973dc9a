"""torch <-> Flax NNX weight conversion (jdist.testing), with torch as the oracle.

Each model is defined twice (torch and NNX, same layers in the same order); after a
conversion both must give the same outputs (1e-5) and round trips must reproduce the
weights exactly.
"""

from __future__ import annotations

import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from torch import nn

from jdist.errors import WeightConversionError
from jdist.testing import (
    flax_to_torch_momentum,
    nnx_state_to_torch_state_dict,
    nnx_to_torch,
    paired_layers,
    state_dict_to_nnx,
    torch_to_flax_momentum,
    torch_to_nnx,
)

torch.manual_seed(0)
RTOL = ATOL = 1e-5


def close(a, b, tol=ATOL):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def tnp(t):
    return t.detach().numpy()


@nnx.jit
def fwd(model, x):
    """NNX forward as one compiled program (op-by-op dispatch is slow); BatchNorm
    statistics updated in training mode are written back by nnx.jit."""
    return model(x)


def state_equal(a: nn.Module, b: nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        np.testing.assert_array_equal(tnp(sa[k]), tnp(sb[k]), err_msg=k)


# ------------------------------------------------------------------------- models


class TorchMLP(nn.Module):
    def __init__(self, d_in=4, d_hidden=8, d_out=3):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class NnxMLP(nnx.Module):
    def __init__(self, rngs, d_in=4, d_hidden=8, d_out=3):
        self.fc1 = nnx.Linear(d_in, d_hidden, rngs=rngs)
        self.fc2 = nnx.Linear(d_hidden, d_out, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jnp.tanh(self.fc1(x)))


def torch_cnn():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4, momentum=0.1),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2, bias=False),
        nn.Flatten(),
        nn.Linear(6 * 3 * 3, 5),
    )


class NnxCNN(nnx.Module):
    """Channels last; transposes to NCHW before flattening, as torch flattens."""

    def __init__(self, rngs):
        self.layers = nnx.List([
            nnx.Conv(3, 4, (3, 3), padding=1, rngs=rngs),
            nnx.BatchNorm(4, momentum=torch_to_flax_momentum(0.1), epsilon=1e-5, rngs=rngs),
            nnx.Conv(4, 6, (3, 3), strides=2, padding=((1, 1), (1, 1)), feature_group_count=2,
                     use_bias=False, rngs=rngs),
            nnx.Linear(6 * 3 * 3, 5, rngs=rngs),
        ])

    def __call__(self, x_nhwc):
        conv1, bn, conv2, fc = self.layers
        h = conv2(nnx.relu(bn(conv1(x_nhwc))))
        return fc(h.transpose(0, 3, 1, 2).reshape(h.shape[0], -1))


class TorchSeq(nn.Module):
    """Embedding -> LayerNorm -> Conv1d -> BatchNorm1d -> Linear (Conv1d is NCL)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.norm = nn.LayerNorm(6)
        self.conv = nn.Conv1d(6, 5, 3)
        self.bn = nn.BatchNorm1d(5)
        self.head = nn.Linear(5, 2)

    def forward(self, ids):
        h = self.norm(self.emb(ids)).transpose(1, 2)
        return self.head(self.bn(self.conv(h)).mean(-1))


class NnxSeq(nnx.Module):
    def __init__(self, rngs):
        self.emb = nnx.Embed(11, 6, rngs=rngs)
        self.norm = nnx.LayerNorm(6, epsilon=1e-5, rngs=rngs)
        self.conv = nnx.Conv(6, 5, (3,), padding="VALID", rngs=rngs)
        self.bn = nnx.BatchNorm(5, momentum=0.9, rngs=rngs)
        self.head = nnx.Linear(5, 2, rngs=rngs)

    def __call__(self, ids):
        return self.head(self.bn(self.conv(self.norm(self.emb(ids)))).mean(1))


def randomise_bn_stats(model: nn.Module, seed=1):
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g))
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            with torch.no_grad():
                m.weight.copy_(torch.randn(m.num_features, generator=g))
                m.bias.copy_(torch.randn(m.num_features, generator=g))


# --------------------------------------------------------------------------- tests


def test_mlp_round_trips_and_forward_match():
    tm, nm = TorchMLP(), NnxMLP(nnx.Rngs(0))
    assert torch_to_nnx(tm, nm) is nm
    x = np.random.RandomState(0).randn(7, 4).astype(np.float32)
    close(fwd(nm, jnp.asarray(x)), tnp(tm(torch.from_numpy(x))))
    close(nm.fc1.kernel.get_value(), tnp(tm.fc1.weight).T, 0)
    # nnx -> a fresh torch model reproduces the original weights exactly
    fresh = TorchMLP()
    assert nnx_to_torch(nm, fresh) is fresh
    state_equal(tm, fresh)
    # and the other way round, starting from an nnx model
    nm2, tm2 = NnxMLP(nnx.Rngs(5)), TorchMLP()
    nnx_to_torch(nm2, tm2)
    close(tnp(tm2(torch.from_numpy(x))), fwd(nm2, jnp.asarray(x)))
    back = torch_to_nnx(tm2, NnxMLP(nnx.Rngs(9)))
    for a, b in zip(nnx.state(nm2, nnx.Param).flat_state(),
                    nnx.state(back, nnx.Param).flat_state(), strict=True):
        np.testing.assert_array_equal(np.asarray(a[1].get_value()),
                                      np.asarray(b[1].get_value()))
    assert paired_layers(tm, nm) == [("fc1", "fc1", "linear"), ("fc2", "fc2", "linear")]


def test_cnn_with_batchnorm_eval_and_training_forward():
    tm = torch_cnn()
    randomise_bn_stats(tm)
    nm = torch_to_nnx(tm, NnxCNN(nnx.Rngs(0)))
    assert [p[1] for p in paired_layers(tm, nm)] == [f"layers.{i}" for i in range(4)]
    x = np.random.RandomState(2).randn(4, 3, 6, 6).astype(np.float32)
    x_nhwc = jnp.asarray(x.transpose(0, 2, 3, 1))

    tm.eval()
    nm.eval()
    close(fwd(nm, x_nhwc), tnp(tm(torch.from_numpy(x))))

    # one training-mode forward: batch statistics, running statistics updated
    tm.train()
    nm.train()
    bn_in = tnp(tm[0](torch.from_numpy(x)))  # BatchNorm input, NCHW
    old_var = tnp(tm[1].running_var).copy()
    close(fwd(nm, x_nhwc), tnp(tm(torch.from_numpy(x))))
    bn_t, bn_n = tm[1], nm.layers[1]
    close(bn_n.mean.get_value(), tnp(bn_t.running_mean))
    # torch's running_var uses the unbiased batch variance, flax's the biased one
    n = bn_in.shape[0] * bn_in.shape[2] * bn_in.shape[3]
    biased = bn_in.var(axis=(0, 2, 3), dtype=np.float64)
    close(tnp(bn_t.running_var), 0.9 * old_var + 0.1 * biased * n / (n - 1))
    close(bn_n.var.get_value(), 0.9 * old_var + 0.1 * biased)
    close(bn_n.var.get_value(), tnp(bn_t.running_var) - 0.1 * biased / (n - 1))

    # nnx -> torch carries the updated running statistics; num_batches_tracked untouched
    fresh = torch_cnn()
    nnx_to_torch(nm, fresh)
    close(tnp(fresh[1].running_mean), tnp(bn_t.running_mean))
    close(tnp(fresh[1].running_var), bn_n.var.get_value(), 0)
    assert int(fresh[1].num_batches_tracked) == 0
    fresh.eval()
    nm.eval()
    close(tnp(fresh(torch.from_numpy(x))), fwd(nm, x_nhwc))


def test_embedding_layernorm_conv1d_batchnorm1d_model():
    tm = TorchSeq()
    randomise_bn_stats(tm, seed=3)
    with torch.no_grad():
        tm.norm.weight.normal_()
        tm.norm.bias.normal_()
    tm.eval()
    nm = torch_to_nnx(tm, NnxSeq(nnx.Rngs(0)))
    nm.eval()
    ids = np.random.RandomState(3).randint(0, 11, (5, 9))
    close(fwd(nm, jnp.asarray(ids)), tnp(tm(torch.from_numpy(ids))))
    fresh = TorchSeq()
    nnx_to_torch(nm, fresh)
    for k in ("emb.weight", "norm.weight", "norm.bias", "conv.weight", "conv.bias",
              "bn.weight", "bn.running_mean", "bn.running_var", "head.weight"):
        np.testing.assert_array_equal(tnp(fresh.state_dict()[k]), tnp(tm.state_dict()[k]))


def test_state_dict_functions_round_trip():
    tm = torch_cnn()
    randomise_bn_stats(tm, seed=4)
    sd = tm.state_dict()
    nm = state_dict_to_nnx(sd, NnxCNN(nnx.Rngs(1)))
    # numpy values work too (no torch needed)
    nm_np = state_dict_to_nnx({k: tnp(v) for k, v in sd.items()}, NnxCNN(nnx.Rngs(2)))
    out = nnx_state_to_torch_state_dict(nm, tm.state_dict())
    assert list(out) == list(sd)
    for k in sd:
        assert out[k].dtype == sd[k].dtype, k
        np.testing.assert_array_equal(tnp(out[k]), tnp(sd[k]), err_msg=k)
    fresh = torch_cnn()
    fresh.load_state_dict(nnx_state_to_torch_state_dict(nm_np, fresh.state_dict()))
    state_equal(fresh, tm)
    plain = nnx_state_to_torch_state_dict(NnxMLP(nnx.Rngs(0)))
    assert list(plain) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert tuple(plain["fc1.weight"].shape) == (8, 4)
    TorchMLP().load_state_dict(plain)
    with pytest.raises(WeightConversionError, match=r"entries '0' \['bias', 'weight'\] do "
                       r"not look like a linear as nnx 'fc1' \(Linear\) expects"):
        state_dict_to_nnx(nn.Sequential(nn.LayerNorm(4), nn.Linear(8, 3)).state_dict(),
                          NnxMLP(nnx.Rngs(0)))
    with pytest.raises(WeightConversionError, match="state_dict has 5 modules with tensors"):
        state_dict_to_nnx(TorchSeq().state_dict(), NnxMLP(nnx.Rngs(0)))


def test_nnx_definition_order_not_alphabetical():
    class TZ(nn.Module):
        def __init__(self):
            super().__init__()
            self.zeta = nn.Linear(2, 3)
            self.alpha = nn.Linear(3, 4)

    class NZ(nnx.Module):
        def __init__(self, rngs):
            self.zeta = nnx.Linear(2, 3, rngs=rngs)
            self.alpha = nnx.Linear(3, 4, rngs=rngs)

        def __call__(self, x):
            return self.alpha(self.zeta(x))

    tm, nm = TZ(), NZ(nnx.Rngs(0))
    # nnx.jit and split/merge rewrite __dict__ in sorted order; the pairing must not change
    fwd(nm, jnp.ones((1, 2)))
    nm = nnx.merge(*nnx.split(nm))
    torch_to_nnx(tm, nm)
    close(nm.zeta.kernel.get_value(), tnp(tm.zeta.weight).T, 0)
    assert paired_layers(tm, nm) == [("zeta", "zeta", "linear"), ("alpha", "alpha", "linear")]


def test_mismatches_raise_naming_both_paths():
    # count
    three = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3))
    with pytest.raises(WeightConversionError, match=r"3 convertible layers.*nnx model has 2"
                       r"(.|\n)*'fc2' \(Linear\)"):
        torch_to_nnx(three, NnxMLP(nnx.Rngs(0)))
    # kind
    kinds = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    with pytest.raises(WeightConversionError, match=r"torch '1' \(LayerNorm\) is a layernorm "
                       r"but nnx 'fc2' \(Linear\) is a linear"):
        torch_to_nnx(kinds, NnxMLP(nnx.Rngs(0)))
    # shape, both directions; a failed copy writes nothing (fc2 fails after fc1 passed)
    nm = NnxMLP(nnx.Rngs(0))
    before = np.asarray(nm.fc1.kernel.get_value()).copy()
    with pytest.raises(WeightConversionError, match=r"torch 'fc2' \(Linear\) 'weight' gives "
                       r"\(8, 2\).*nnx 'fc2' \(Linear\) 'kernel' has \(8, 3\)"):
        torch_to_nnx(TorchMLP(d_out=2), nm)
    np.testing.assert_array_equal(np.asarray(nm.fc1.kernel.get_value()), before)
    with pytest.raises(WeightConversionError, match=r"torch 'fc1' \(Linear\) 'weight' gives "
                       r"\(4, 7\).*nnx 'fc1' \(Linear\) 'kernel' has \(4, 8\)"):
        torch_to_nnx(TorchMLP(d_hidden=7), NnxMLP(nnx.Rngs(0)))
    with pytest.raises(WeightConversionError, match=r"nnx 'fc2' \(Linear\) 'kernel' gives "
                       r"\(3, 8\).*torch 'fc2' \(Linear\) 'weight' has \(2, 8\)"):
        nnx_to_torch(NnxMLP(nnx.Rngs(0)), TorchMLP(d_out=2))
    # a bias on one side only
    tm = nn.Sequential(nn.Linear(4, 8, bias=False), nn.Linear(8, 3))
    nm = NnxMLP(nnx.Rngs(0))
    old_bias = np.asarray(nm.fc1.bias.get_value()).copy()
    with pytest.raises(WeightConversionError, match=r"nnx 'fc1' \(Linear\) has 'bias' but "
                       r"torch '0' \(Linear\) has no 'bias'"):
        torch_to_nnx(tm, nm)
    torch_to_nnx(tm, nm, strict=False)
    np.testing.assert_array_equal(np.asarray(nm.fc1.bias.get_value()), old_bias)
    close(nm.fc1.kernel.get_value(), tnp(tm[0].weight).T, 0)


def test_hyperparameter_checks():
    class TN(nn.Module):
        def __init__(self, momentum=0.1):
            super().__init__()
            self.ln = nn.LayerNorm(4)
            self.bn = nn.BatchNorm1d(4, momentum=momentum)

    class NN(nnx.Module):
        def __init__(self, rngs, ln_eps=1e-5, bn_mom=0.9):
            self.ln = nnx.LayerNorm(4, epsilon=ln_eps, rngs=rngs)
            self.bn = nnx.BatchNorm(4, momentum=bn_mom, rngs=rngs)

    torch_to_nnx(TN(), NN(nnx.Rngs(0)))
    with pytest.raises(WeightConversionError, match=r"'ln'.*epsilon: torch eps=1e-05 vs nnx "
                       r"epsilon=1e-06"):
        torch_to_nnx(TN(), NN(nnx.Rngs(0), ln_eps=1e-6))
    with pytest.raises(WeightConversionError, match=r"torch momentum=0.1 means nnx "
                       r"momentum=0.9, got 0.99"):
        nnx_to_torch(NN(nnx.Rngs(0), bn_mom=0.99), TN())
    with pytest.raises(WeightConversionError, match="momentum=None"):
        torch_to_nnx(TN(momentum=None), NN(nnx.Rngs(0)))
    torch_to_nnx(TN(), NN(nnx.Rngs(0), ln_eps=1e-6), check_config=False)
    conv_t = nn.Conv2d(3, 4, 3)  # torch default padding 0 vs nnx default SAME
    with pytest.raises(WeightConversionError, match=r"padding: torch \(\(0, 0\), \(0, 0\)\) "
                       r"vs nnx 'SAME'"):
        torch_to_nnx(conv_t, nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0)))
    with pytest.raises(WeightConversionError, match=r"stride: torch \(2, 2\) vs nnx \(1, 1\)"):
        torch_to_nnx(nn.Conv2d(3, 4, 3, stride=2),
                     nnx.Conv(3, 4, (3, 3), padding="VALID", rngs=nnx.Rngs(0)))
    assert torch_to_flax_momentum(0.1) == 0.9
    assert flax_to_torch_momentum(0.99) == 0.01
    with pytest.raises(ValueError, match="momentum must be a number in"):
        torch_to_flax_momentum(1.5)


def test_unsupported_layers_and_bad_arguments():
    class WithPReLU(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(4, 8)
            self.act = nn.PReLU()
            self.fc2 = nn.Linear(8, 3)

    class NnxWithParam(nnx.Module):
        def __init__(self, rngs):
            self.fc1 = nnx.Linear(4, 8, rngs=rngs)
            self.scale = nnx.Param(jnp.ones(()))
            self.fc2 = nnx.Linear(8, 3, rngs=rngs)

    with pytest.raises(WeightConversionError, match=r"torch model .* 'act' \(PReLU\).*"
                       r"strict=False"):
        torch_to_nnx(WithPReLU(), NnxMLP(nnx.Rngs(0)))
    tm = WithPReLU()
    nm = torch_to_nnx(tm, NnxMLP(nnx.Rngs(0)), strict=False)
    close(nm.fc2.kernel.get_value(), tnp(tm.fc2.weight).T, 0)
    with pytest.raises(WeightConversionError, match=r"nnx model .* '<root>' \(NnxWithParam\)"):
        nnx_to_torch(NnxWithParam(nnx.Rngs(0)), TorchMLP())
    nnx_to_torch(NnxWithParam(nnx.Rngs(0)), TorchMLP(), strict=False)
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        torch_to_nnx(NnxMLP(nnx.Rngs(0)), NnxMLP(nnx.Rngs(0)))
    with pytest.raises(TypeError, match="expected a flax.nnx.Module"):
        torch_to_nnx(TorchMLP(), TorchMLP())
    with pytest.raises(WeightConversionError, match="uninitialized"):
        torch_to_nnx(nn.Sequential(nn.LazyLinear(3)), nnx.Linear(4, 3, rngs=nnx.Rngs(0)))


def test_import_does_not_load_torch():
    code = "import sys, jdist.testing; assert 'torch' not in sys.modules, 'torch imported'"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=str(__import__("pathlib").Path(__file__).parents[2]))
    assert res.returncode == 0, res.stderr[-2000:]


def test_converted_arrays_do_not_alias_torch_parameters():
    import jdist.testing as jt

    tl = torch.nn.Linear(3, 2)
    nl = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    jt.torch_to_nnx(tl, nl)
    before = np.asarray(nl.bias.get_value()).copy()
    with torch.no_grad():
        tl.bias.add_(1.0)
        tl.weight.mul_(2.0)
    np.testing.assert_array_equal(np.asarray(nl.bias.get_value()), before)
    np.testing.assert_allclose(np.asarray(nl.kernel.get_value()).T * 2.0,
                               tl.weight.detach().numpy(), rtol=1e-6)


# ------------------------------------------------------------------ EmbeddingBag


def _bag_inputs():
    """1-D indices with offsets (an empty bag in the middle) and a 2-D batch."""
    rs = np.random.RandomState(3)
    idx = rs.randint(0, 9, size=13).astype(np.int64)
    off = np.array([0, 4, 4, 9], np.int64)  # bag 1 is empty
    psw = rs.rand(13).astype(np.float32)
    return idx, off, psw, rs.randint(0, 9, size=(3, 5)).astype(np.int64)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_matches_torch_forward_and_gradient(mode):
    from jdist.testing import EmbeddingBag

    idx, off, psw, idx2 = _bag_inputs()
    t = nn.EmbeddingBag(9, 4, mode=mode)
    n = torch_to_nnx(t, EmbeddingBag(9, 4, mode=mode, rngs=nnx.Rngs(0)))
    close(n.embedding[...], tnp(t.weight), 0)
    cases = [((idx, off), {}), ((idx2,), {})]
    if mode == "sum":
        cases.append(((idx, off), {"per_sample_weights": psw}))
    for args, kw in cases:
        t.zero_grad()
        out_t = t(*[torch.from_numpy(a) for a in args],
                  **{k: torch.from_numpy(v) for k, v in kw.items()})
        (out_t * torch.arange(out_t.numel()).reshape(out_t.shape)).sum().backward()

        def f(model, args=args, kw=kw):
            out = model(*args, **kw)
            return (out * jnp.arange(out.size).reshape(out.shape)).sum(), out

        (_, out_n), g = nnx.value_and_grad(f, has_aux=True)(n)
        close(out_n, tnp(out_t))
        close(g.embedding[...], tnp(t.weight.grad))
    if mode != "max":
        assert np.abs(tnp(t(torch.from_numpy(idx), torch.from_numpy(off)))[1]).max() == 0


def test_embedding_bag_last_offset_padding_idx_jit_and_round_trip():
    from jdist.testing import EmbeddingBag

    idx, off, _, _ = _bag_inputs()
    t = nn.EmbeddingBag(9, 4, mode="mean", include_last_offset=True, padding_idx=2)
    n = EmbeddingBag(9, 4, mode="mean", include_last_offset=True, padding_idx=2,
                     rngs=nnx.Rngs(1))
    assert float(jnp.abs(n.embedding[2]).max()) == 0  # torch zeroes the padding row too
    torch_to_nnx(t, n)
    last = np.append(off, 11)  # indices 11, 12 lie past the end: ignored (padding)
    want = tnp(t(torch.from_numpy(idx[:11]), torch.from_numpy(last)))
    close(n(idx, last), want)
    close(nnx.jit(lambda m, i, o: m(i, o))(n, idx, last), want)  # one compiled program
    back = nn.EmbeddingBag(9, 4, mode="mean", include_last_offset=True, padding_idx=2)
    nnx_to_torch(n, back)
    state_equal(t, back)
    fresh = EmbeddingBag(9, 4, mode="mean", include_last_offset=True, padding_idx=2,
                         rngs=nnx.Rngs(5))
    state_dict_to_nnx({k: tnp(v) for k, v in t.state_dict().items()}, fresh)
    close(fresh.embedding[...], tnp(t.weight), 0)
    assert list(nnx_state_to_torch_state_dict(n)) == ["weight"]
    assert paired_layers(t, n) == [("", "", "embeddingbag")]


def test_embedding_bag_mismatches_and_bad_inputs_raise():
    from jdist.testing import EmbeddingBag

    n = EmbeddingBag(9, 4, mode="sum", rngs=nnx.Rngs(0))
    with pytest.raises(WeightConversionError, match="mode: torch 'max' vs nnx 'sum'"):
        torch_to_nnx(nn.EmbeddingBag(9, 4, mode="max"), n)
    with pytest.raises(WeightConversionError, match="padding_idx"):
        torch_to_nnx(nn.EmbeddingBag(9, 4, mode="sum", padding_idx=0), n)
    with pytest.raises(WeightConversionError, match="max_norm"):
        torch_to_nnx(nn.EmbeddingBag(9, 4, mode="sum", max_norm=1.0), n)
    with pytest.raises(WeightConversionError, match=r"\(9, 4\)"):
        torch_to_nnx(nn.EmbeddingBag(8, 4, mode="sum"), n)
    with pytest.raises(WeightConversionError, match="embeddingbag"):
        torch_to_nnx(nn.Embedding(9, 4), n)
    idx = np.arange(6)
    with pytest.raises(ValueError, match="'median'"):
        EmbeddingBag(9, 4, mode="median", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs offsets"):
        n(idx)
    with pytest.raises(ValueError, match="offsets must be None"):
        n(idx.reshape(2, 3), np.array([0, 1]))
    with pytest.raises(ValueError, match=r"\[0, 4, 2\]"):
        n(idx, np.array([0, 4, 2]))
    with pytest.raises(ValueError, match="mode='sum', got mode='mean'"):
        EmbeddingBag(9, 4, rngs=nnx.Rngs(0))(idx, np.array([0]),
                                             per_sample_weights=np.ones(6))
    with pytest.raises(ValueError, match="padding_idx must be within"):
        EmbeddingBag(9, 4, padding_idx=9, rngs=nnx.Rngs(0))
