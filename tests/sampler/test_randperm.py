"""jdist.sampler.randperm against torch.randperm (the oracle) and a plain swap loop."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jdist.sampler import _randperm as randperm_module
from jdist.sampler import randperm
from jdist.sampler._randperm import _CHUNK, _inside_out


def torch_perm(n, seed, dtype=torch.int64):
    g = torch.Generator()
    g.manual_seed(seed)
    return torch.randperm(n, generator=g, dtype=dtype).numpy()


def loop_perm(n, seed):
    """The textbook definition, one swap at a time (independent of the vectorization)."""
    bit_gen = np.random.MT19937(0)
    bit_gen._legacy_seeding(seed & 0xFFFFFFFF)
    draws = bit_gen.random_raw(max(n - 1, 0)).tolist()
    a = list(range(n))
    for i in range(n - 1):
        j = i + draws[i] % (n - i)
        a[i], a[j] = a[j], a[i]
    return np.array(a, dtype=np.int64)


def loop_inside_out(n, seed):
    """torch's algorithm for n >= 2**32 // 20, one step at a time."""
    bit_gen = np.random.MT19937(0)
    bit_gen._legacy_seeding(seed & 0xFFFFFFFF)
    draws = bit_gen.random_raw(2 * n).tolist()
    a = [0] * n
    for i in range(n):
        z = ((draws[2 * i] << 32) | draws[2 * i + 1]) % (i + 1)
        a[i] = a[z]
        a[z] = i
    return np.array(a, dtype=np.int64)


SEEDS = [0, 1, 42, 2**31 - 1, 2**32 - 1, 2**32 + 5, 2**63 + 3, 2**64 - 1, -1, -(2**63)]


@pytest.mark.parametrize("seed", SEEDS)
def test_every_small_n_matches_torch(seed):
    for n in range(0, 40):
        np.testing.assert_array_equal(randperm(n, seed), torch_perm(n, seed), err_msg=str(n))


@pytest.mark.parametrize(
    "n", [_CHUNK - 1, _CHUNK, _CHUNK + 1, _CHUNK + 2, 2 * _CHUNK + 1, 65535, 65536, 65537,
          65538, 3 * _CHUNK + 65537])
def test_chunk_and_radix_boundaries_match_torch(n):
    for seed in (0, 2**32 + 7):
        np.testing.assert_array_equal(randperm(n, seed), torch_perm(n, seed))


@given(n=st.integers(0, 3000), seed=st.integers(-(2**63), 2**64 - 1))
@settings(max_examples=60, deadline=None)
def test_matches_plain_swap_loop(n, seed):
    np.testing.assert_array_equal(randperm(n, seed), loop_perm(n, seed))


@pytest.mark.parametrize("chunk", [4, 8, 64, _CHUNK])
def test_inside_out_matches_its_loop(monkeypatch, chunk):
    # torch runs this algorithm only for n >= 214748364 (checked against torch by
    # `benchmarks/sampler.py --large`); here its vectorization is checked at small n
    # with small chunks, so that chunk boundaries and pointer chains are exercised
    monkeypatch.setattr(randperm_module, "_CHUNK", chunk)
    for n in [1, 2, 3, 5, 9, 31, 100, 1000, 4099]:
        for seed in (0, 2**32 + 9):
            np.testing.assert_array_equal(_inside_out(n, seed, np.int64),
                                          loop_inside_out(n, seed), err_msg=str(n))


def test_large_n_switches_to_inside_out(monkeypatch):
    monkeypatch.setattr(randperm_module, "TORCH_SWAP_LIMIT", 100)
    np.testing.assert_array_equal(randperm(99, 3), loop_perm(99, 3))
    np.testing.assert_array_equal(randperm(100, 3), loop_inside_out(100, 3))
    np.testing.assert_array_equal(randperm(5000, 3), loop_inside_out(5000, 3))


def test_seed_is_truncated_to_32_bits_like_torch():
    np.testing.assert_array_equal(randperm(1000, 2**32 + 5), randperm(1000, 5))
    np.testing.assert_array_equal(torch_perm(1000, 2**32 + 5), torch_perm(1000, 5))


def test_dtype_changes_type_not_values():
    for dtype, tdtype in [(np.int32, torch.int32), (np.int16, torch.int16)]:
        out = randperm(5000, 3, dtype=dtype)
        assert out.dtype == dtype
        np.testing.assert_array_equal(out, torch_perm(5000, 3, tdtype))


def test_one_million_matches_torch():
    np.testing.assert_array_equal(randperm(10**6, 2024), torch_perm(10**6, 2024))


def test_ten_million_matches_torch():
    np.testing.assert_array_equal(randperm(10**7, 7), torch_perm(10**7, 7))


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="non-negative, got -1"):
        randperm(-1, 0)
    with pytest.raises(TypeError, match="n must be an int, got 2.5"):
        randperm(2.5, 0)
    with pytest.raises(ValueError, match="seed 18446744073709551616 is outside"):
        randperm(10, 2**64)
    with pytest.raises(ValueError, match="is outside"):
        randperm(10, -(2**63) - 1)
    with pytest.raises(TypeError, match="seed must be an int"):
        randperm(10, "0")


def test_torch_rejects_the_same_seeds():
    g = torch.Generator()
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises((ValueError, RuntimeError, OverflowError)):
            g.manual_seed(seed)
