"""torch <-> NNX conversion of attention, transformer encoder and recurrent layers.

Generated grids (sizes, heads, kdim/vdim, bias, batch_first, sequence lengths, layers,
directions) with random weights and inputs; torch's forward is the oracle (1e-5,
float32) and ``nnx_to_torch(torch_to_nnx(...))`` must give torch's state_dict exactly.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from torch import nn

from jdist.errors import WeightConversionError
from jdist.testing import (
    GRU,
    LSTM,
    TransformerEncoderLayer,
    nnx_state_to_torch_state_dict,
    nnx_to_torch,
    paired_layers,
    state_dict_to_nnx,
    torch_to_nnx,
)

TOL = 1e-5


def abstract(make):
    """An NNX module with shapes only (no initialisation compiled): the converters fill
    every parameter from torch, which keeps these tests fast."""
    return nnx.eval_shape(make)


@nnx.jit
def call(module, *args):
    return module(*args)


@nnx.jit
def attend(module, q, k, v, mask):
    return module(q, k, v, mask=mask)


@nnx.jit
def encode(module, x, mask):
    return module(x, mask=mask)


def j(t):
    return jnp.asarray(t.detach().numpy())


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=TOL, atol=TOL)


def round_trip(tm, nm, make_torch):
    """nnx -> a fresh torch module must reproduce tm's state_dict exactly, and so must
    the state_dict functions."""
    fresh = nnx_to_torch(nm, make_torch())
    sd, sd2 = tm.state_dict(), fresh.state_dict()
    assert list(sd) == list(sd2)
    for k in sd:
        np.testing.assert_array_equal(sd2[k].numpy(), sd[k].numpy(), err_msg=k)
    out = nnx_state_to_torch_state_dict(nm, sd)
    assert list(out) == list(sd)
    for k in sd:
        np.testing.assert_array_equal(out[k].numpy(), sd[k].numpy(), err_msg=k)
    return fresh


def randomize(tm, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in tm.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


# ------------------------------------------------------------ multi-head attention

# (embed, heads, kdim (= vdim; None: packed), bias, batch_first, Lq, Lk)
# (embed, heads, kdim (= vdim; None: packed), bias, batch_first, Lq, Lk): every pair of
# settings occurs
MHA_GRID = [((8, 2), (12, 3))[(kv is None) ^ b ^ bf] + (kv, b, bf) +
            ((4, 4), (3, 6))[(kv is None) ^ bf]
            for kv, b, bf in itertools.product([None, 5], [True, False], [True, False])]


@pytest.mark.parametrize("e,h,kv,bias,bf,lq,lk", MHA_GRID)
def test_multihead_attention_forward_and_round_trip(e, h, kv, bias, bf, lq, lk):
    seed = hash((e, h, kv, bias, bf, lq, lk)) % 1000
    tm = nn.MultiheadAttention(e, h, bias=bias, batch_first=bf, kdim=kv, vdim=kv)
    randomize(tm, seed)
    nm = abstract(lambda: nnx.MultiHeadAttention(h, e, in_kv_features=kv, use_bias=bias,
                                                 decode=False, rngs=nnx.Rngs(seed)))
    assert torch_to_nnx(tm, nm) is nm
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, lq, e, generator=g)
    k = torch.randn(2, lk, kv or e, generator=g)
    v = torch.randn(2, lk, kv or e, generator=g)
    masked = torch.rand(lq, lk, generator=g) < 0.3
    masked[:, 0] = False  # every query sees a key
    tq, tk, tv = ((x if bf else x.transpose(0, 1)) for x in (q, k, v))
    want, _ = tm(tq, tk, tv, attn_mask=masked, need_weights=False)
    want = want if bf else want.transpose(0, 1)
    close(attend(nm, j(q), j(k), j(v), ~j(masked)), want.detach().numpy())
    round_trip(tm, nm, lambda: nn.MultiheadAttention(e, h, bias=bias, batch_first=bf,
                                                     kdim=kv, vdim=kv))
    back = state_dict_to_nnx(tm.state_dict(), abstract(lambda: nnx.MultiHeadAttention(
        h, e, in_kv_features=kv, use_bias=bias, decode=False, rngs=nnx.Rngs(1))))
    for a, b in zip(nnx.to_flat_state(nnx.state(back, nnx.Param)),
                    nnx.to_flat_state(nnx.state(nm, nnx.Param)), strict=True):
        np.testing.assert_array_equal(np.asarray(a[1].get_value()),
                                      np.asarray(b[1].get_value()))


def mha(heads, e, **kw):
    return abstract(lambda: nnx.MultiHeadAttention(heads, e, decode=False, rngs=nnx.Rngs(0),
                                                   **kw))


def test_multihead_attention_without_counterpart_raises():
    nm = mha(2, 8, in_kv_features=4)
    with pytest.raises(WeightConversionError, match=r"kdim=4 vs vdim=6.*kdim == vdim"):
        torch_to_nnx(nn.MultiheadAttention(8, 2, kdim=4, vdim=6), nm)
    with pytest.raises(WeightConversionError, match=r"arrays with no counterpart: torch "
                       r"\['bias_k', 'bias_v'\]"):
        torch_to_nnx(nn.MultiheadAttention(8, 2, add_bias_kv=True), mha(2, 8))
    with pytest.raises(WeightConversionError, match="add_zero_attn=True"):
        torch_to_nnx(nn.MultiheadAttention(8, 2, add_zero_attn=True), mha(2, 8))
    with pytest.raises(WeightConversionError, match="num_heads: torch 4 vs nnx 2"):
        torch_to_nnx(nn.MultiheadAttention(8, 4), mha(2, 8))
    # packed torch vs separate nnx: even without the config check, never silent
    with pytest.raises(WeightConversionError, match="built differently"):
        torch_to_nnx(nn.MultiheadAttention(8, 2), nm, check_config=False, strict=False)
    with pytest.raises(WeightConversionError, match="normalize_qk"):
        torch_to_nnx(nn.MultiheadAttention(8, 2), mha(2, 8, normalize_qk=True),
                     check_config=False)
    with pytest.raises(WeightConversionError, match=r"nnx \['key_ln.scale', 'query_ln.scale'\]"):
        state_dict_to_nnx(nn.MultiheadAttention(8, 2).state_dict(),
                          mha(2, 8, normalize_qk=True))


# ------------------------------------------------------------------- LSTM and GRU

# (torch class, nnx class, in, hidden, layers, bias, bidirectional, batch_first, T)
# every pair of settings occurs
RNN_GRID = [(tc, nc, 3, 5, nl, (nl == 2) ^ bi ^ (tc is nn.GRU), bi, (nl == 2) ^ (tc is nn.GRU),
             2 + 3 * bi)
            for (tc, nc), nl, bi in itertools.product(
                [(nn.LSTM, LSTM), (nn.GRU, GRU)], [1, 2], [False, True])]


@pytest.mark.parametrize("tcls,ncls,din,hid,nl,bias,bi,bf,steps", RNN_GRID)
def test_lstm_gru_forward_and_round_trip(tcls, ncls, din, hid, nl, bias, bi, bf, steps):
    seed = (nl * 7 + bias * 3 + bi) + (tcls is nn.GRU) * 50
    kw = dict(num_layers=nl, bias=bias, bidirectional=bi, batch_first=bf)
    tm = tcls(din, hid, **kw)
    randomize(tm, seed)
    nm = abstract(lambda: ncls(din, hid, **kw, rngs=nnx.Rngs(seed)))
    torch_to_nnx(tm, nm)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((3, steps, din) if bf else (steps, 3, din), generator=g)
    h0 = torch.randn(nl * (1 + bi), 3, hid, generator=g)
    if tcls is nn.LSTM:
        c0 = torch.randn(nl * (1 + bi), 3, hid, generator=g)
        want, (hn, cn) = tm(x, (h0, c0))
        got, (ghn, gcn) = call(nm, j(x), (j(h0), j(c0)))
        close(gcn, cn.detach().numpy())
    else:
        want, hn = tm(x, h0)
        got, ghn = call(nm, j(x), j(h0))
    close(got, want.detach().numpy())
    close(ghn, hn.detach().numpy())
    if not bf and not bi:  # unbatched input, zero initial state
        close(call(nm, j(x[:, 0]))[0], tm(x[:, 0])[0].detach().numpy())
    round_trip(tm, nm, lambda: tcls(din, hid, **kw))


def test_recurrent_mismatches_raise_naming_the_fix():
    def rnn(cell):
        return abstract(lambda: nnx.RNN(cell(3, 4, rngs=nnx.Rngs(0))))

    def ours(cls, *a, **kw):
        return abstract(lambda: cls(*a, rngs=nnx.Rngs(0), **kw))

    with pytest.raises(WeightConversionError, match=r"'<root>' \(OptimizedLSTMCell\) \[Flax's LSTM "
                       r"cells have one bias per gate.*jdist.testing.LSTM\]"):
        torch_to_nnx(nn.LSTM(3, 4), rnn(nnx.OptimizedLSTMCell).cell)
    with pytest.raises(WeightConversionError, match=r"skipped: nnx '<root>' \(RNN\) \["):
        torch_to_nnx(nn.LSTM(3, 4), rnn(nnx.LSTMCell), strict=False)
    with pytest.raises(WeightConversionError, match=r"\(RNN\).*jdist.testing.LSTM or "
                       r"jdist.testing.GRU"):
        torch_to_nnx(nn.GRU(3, 4), rnn(nnx.GRUCell))
    with pytest.raises(WeightConversionError, match=r"\(GRUCell\) \[nnx.GRUCell has no "
                       r"hidden-side biases, so torch's GRU b_hn.*jdist.testing.GRU"):
        nnx_to_torch(rnn(nnx.GRUCell).cell, nn.GRU(3, 4))
    with pytest.raises(WeightConversionError, match="is a lstm but nnx .* is a gru"):
        torch_to_nnx(nn.LSTM(3, 4), ours(GRU, 3, 4))
    # more torch layers than nnx layers: never a partial copy, even unchecked
    with pytest.raises(WeightConversionError, match=r"torch \['weight_ih_l1', 'weight_hh_l1',"
                       r" 'bias_ih_l1', 'bias_hh_l1'\]"):
        torch_to_nnx(nn.GRU(3, 4, 2), ours(GRU, 3, 4), check_config=False)
    with pytest.raises(WeightConversionError, match="bidirectional: torch True vs nnx False"):
        torch_to_nnx(nn.LSTM(3, 4, bidirectional=True), ours(LSTM, 3, 4))
    with pytest.raises(WeightConversionError, match=r"proj_size=2: jdist.testing.LSTM has no "
                       r"projection"):
        torch_to_nnx(nn.LSTM(3, 4, proj_size=2), ours(LSTM, 3, 4))
    with pytest.raises(WeightConversionError, match=r"torch \['weight_hr_l0'\]"):
        torch_to_nnx(nn.LSTM(3, 4, proj_size=2), ours(LSTM, 3, 4), check_config=False)
    with pytest.raises(WeightConversionError, match=r"nnx '<root>' \(LSTM\) has "
                       r"'cells.0.bias_ih' but torch '<root>' \(LSTM\) has no 'bias_ih_l0'"):
        torch_to_nnx(nn.LSTM(3, 4, bias=False), ours(LSTM, 3, 4), check_config=False)


# ------------------------------------------------------- transformer encoder layer

# every pair of settings occurs
ENC_GRID = [(nf, ("relu", "gelu")[nf ^ bf], bf) for nf, bf in itertools.product([False, True],
                                                                                [False, True])]


@pytest.mark.parametrize("norm_first,act,bf", ENC_GRID)
def test_transformer_encoder_layer_forward_and_round_trip(norm_first, act, bf):
    seed = norm_first * 4 + (act == "gelu") * 2 + bf
    kw = dict(dim_feedforward=16, dropout=0.0, activation=act, batch_first=bf,
              norm_first=norm_first)
    tm = nn.TransformerEncoderLayer(8, 2, **kw).eval()
    randomize(tm, seed)
    nm = abstract(lambda: TransformerEncoderLayer(8, 2, **kw, rngs=nnx.Rngs(seed)))
    torch_to_nnx(tm, nm)
    assert [k for *_, k in paired_layers(tm, nm)] == [
        "transformer_encoder_layer", "mha", "linear", "linear", "layernorm", "layernorm"]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 8, generator=g)
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), 1)
    with torch.no_grad():
        want = tm(x if bf else x.transpose(0, 1), src_mask=causal)
    got = encode(nm, j(x) if bf else j(x.transpose(0, 1)), ~j(causal))
    close(got, want.numpy())
    round_trip(tm, nm, lambda: nn.TransformerEncoderLayer(8, 2, **kw))


def test_transformer_encoder_layer_settings_are_checked():
    def ours(**kw):
        return abstract(lambda: TransformerEncoderLayer(8, 2, 16, dropout=0.0,
                                                        rngs=nnx.Rngs(0), **kw))

    tm = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, norm_first=True)
    with pytest.raises(WeightConversionError, match="norm_first: torch True vs nnx False"):
        torch_to_nnx(tm, ours())
    tm = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation=nn.GELU("tanh"))
    with pytest.raises(WeightConversionError, match=r"activation: torch \"GELU\(approximate="
                       r"'tanh'\)\" vs nnx 'relu'"):
        torch_to_nnx(tm, ours())
    with pytest.raises(WeightConversionError, match="dropout: torch 0.1 vs nnx 0.0"):
        torch_to_nnx(nn.TransformerEncoderLayer(8, 2, 16), ours())
    with pytest.raises(ValueError, match="activation must be one of"):
        ours(activation="tanh")
    # with dropout: converted, then equal to torch once both are in eval mode
    tm = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.5, batch_first=True)
    nm = torch_to_nnx(tm, TransformerEncoderLayer(8, 2, 16, dropout=0.5, batch_first=True,
                                                  rngs=nnx.Rngs(0)))
    x = torch.randn(2, 3, 8)
    assert not np.allclose(encode(nm, j(x), None), tm.eval()(x).detach().numpy(), atol=1e-3)
    nm.eval()
    close(encode(nm, j(x), None), tm(x).detach().numpy())


# ------------------------------------------------------------------- GPT-style model


class TorchGPT(nn.Module):
    def __init__(self, vocab=13, ctx=6, d=8, heads=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        n = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(n))
        h = self.ln1(x)
        future = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=future, need_weights=False)[0]
        x = x + self.proj(nn.functional.gelu(self.fc(self.ln2(x))))
        return self.head(self.ln_f(x))


class NnxGPT(nnx.Module):
    def __init__(self, rngs, vocab=13, ctx=6, d=8, heads=2):
        self.tok = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Embed(ctx, d, rngs=rngs)
        self.ln1 = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
        self.fc = nnx.Linear(d, 4 * d, rngs=rngs)
        self.proj = nnx.Linear(4 * d, d, rngs=rngs)
        self.ln_f = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
        self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

    def __call__(self, ids):
        x = self.tok(ids) + self.pos(jnp.arange(ids.shape[1]))
        x = x + self.attn(self.ln1(x), mask=nnx.make_causal_mask(ids))
        x = x + self.proj(nnx.gelu(self.fc(self.ln2(x)), approximate=False))
        return self.head(self.ln_f(x))


def test_gpt_block_converts_whole():
    tm = TorchGPT()
    randomize(tm, 3)
    nm = torch_to_nnx(tm, abstract(lambda: NnxGPT(nnx.Rngs(0))))
    ids = torch.randint(0, 13, (3, 6), generator=torch.Generator().manual_seed(0))
    close(call(nm, j(ids)), tm(ids).detach().numpy())
    fresh = round_trip(tm, nm, TorchGPT)
    close(fresh(ids).detach().numpy(), tm(ids).detach().numpy())
    plain = TorchGPT()  # keys from the nnx paths and torch's names; a strict load
    plain.load_state_dict(nnx_state_to_torch_state_dict(nm))
    close(plain(ids).detach().numpy(), tm(ids).detach().numpy())
    assert [k for *_, k in paired_layers(tm, nm)] == [
        "embedding", "embedding", "layernorm", "mha", "layernorm", "linear", "linear",
        "layernorm", "linear"]
