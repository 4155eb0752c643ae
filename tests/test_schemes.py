"""Frequency schemes: ``tileops_cupy.schemes`` and the test oracle, both against
``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``, and the schemes' validation.

HF builds inv_freq in float32 (and, for YaRN, its ramp too), so the cross-check allows
float32 rounding (``HF_RTOL``); the package and the oracle, both float64, must agree to
a few float64 ulps.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from _oracle import (
    llama31_frequencies,
    longrope_frequencies,
    standard_frequencies,
    yarn_frequencies,
)

from tileops_cupy import schemes
from tileops_cupy.rope import RoPE, YaRNFwdOp
from tileops_cupy.schemes import Llama31, LongRoPE, Standard, YaRN

HF_RTOL = 4e-6  # float32 powers and products in HF, a few ulps each
FLOAT64_RTOL = 1e-13

torch = pytest.importorskip("torch")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")


def _hf_config(head_dim: int, base: float, max_position_embeddings: int, rope_scaling=None):
    """A LlamaConfig in the convention both transformers 4.x and 5.x read: ``rope_theta``
    and a ``rope_scaling`` dict (5.x moves them into ``rope_parameters`` itself); the
    pretraining length also as an attribute, where 4.x LongRoPE looks for it."""
    from transformers import LlamaConfig

    kwargs = dict(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_theta=base,
    )
    if rope_scaling is not None:
        kwargs["rope_scaling"] = dict(rope_scaling)
        if "original_max_position_embeddings" in rope_scaling:
            kwargs["original_max_position_embeddings"] = rope_scaling[
                "original_max_position_embeddings"
            ]
    return LlamaConfig(**kwargs)


def _hf(rope_type: str, config, seq_len=None) -> tuple[np.ndarray, float]:
    if rope_type == "default":
        init = rope_utils.ROPE_INIT_FUNCTIONS.get("default")
        if init is None:  # transformers 5.x: the default lives on the model's rotary class
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

            inv, amplitude = LlamaRotaryEmbedding.compute_default_rope_parameters(config=config)
            return inv.double().numpy(), float(amplitude)
    else:
        init = rope_utils.ROPE_INIT_FUNCTIONS[rope_type]
    inv, amplitude = init(config, torch.device("cpu"), seq_len=seq_len)
    return inv.double().numpy(), float(amplitude)


def _check(ours: schemes.Scheme, oracle, hf: tuple[np.ndarray, float], rotary_dim: int):
    inv, amplitude = ours.inv_freq(rotary_dim), ours.amplitude(rotary_dim)
    assert isinstance(inv, np.ndarray) and inv.dtype == np.float64
    assert inv.shape == (rotary_dim // 2,)
    np.testing.assert_allclose(inv, oracle.inv_freq, rtol=FLOAT64_RTOL, atol=0)
    assert amplitude == pytest.approx(oracle.amplitude, rel=FLOAT64_RTOL)
    np.testing.assert_allclose(oracle.inv_freq, hf[0], rtol=HF_RTOL, atol=0)
    assert oracle.amplitude == pytest.approx(hf[1], rel=1e-12)


@pytest.mark.parametrize("rotary_dim", (16, 64, 80, 128))
@pytest.mark.parametrize("base", (100.0, 10000.0, 500000.0, 1e6))
def test_standard_matches_transformers(base, rotary_dim):
    hf = _hf("default", _hf_config(rotary_dim, base, 4096))
    _check(Standard(base), standard_frequencies(rotary_dim, base), hf, rotary_dim)


LLAMA31_CASES = [
    # base, scale_factor, low_freq_factor, high_freq_factor, original_max_position
    (500000.0, 8.0, 1.0, 4.0, 8192),  # Llama 3.1
    (500000.0, 32.0, 1.0, 4.0, 8192),  # Llama 3.2
    (10000.0, 8.0, 1.0, 4.0, 8192),  # the seed's defaults
    (10000.0, 4.0, 2.0, 8.0, 512),
]


@pytest.mark.parametrize("rotary_dim", (64, 128))
@pytest.mark.parametrize("params", LLAMA31_CASES, ids=str)
def test_llama31_matches_transformers(params, rotary_dim):
    base, scale_factor, low, high, original = params
    config = _hf_config(
        rotary_dim, base, original * 16,
        dict(rope_type="llama3", factor=scale_factor, low_freq_factor=low,
             high_freq_factor=high, original_max_position_embeddings=original),
    )  # fmt: skip
    ours = Llama31(base, scale_factor, low, high, original)
    oracle = llama31_frequencies(rotary_dim, base, scale_factor, low, high, original)
    # every regime (kept, divided, blended) is exercised by at least one of the cases
    _check(ours, oracle, _hf("llama3", config), rotary_dim)


def test_llama31_cases_cover_every_regime():
    regimes = set()
    for base, scale_factor, low, high, original in LLAMA31_CASES:
        oracle = llama31_frequencies(128, base, scale_factor, low, high, original)
        inv0 = standard_frequencies(128, base).inv_freq
        ratio = inv0 / oracle.inv_freq
        regimes |= {"kept" for r in ratio if r == 1} | {
            "divided" for r in ratio if r == scale_factor
        }
        regimes |= {"blended" for r in ratio if 1 < r < scale_factor}
    assert regimes == {"kept", "divided", "blended"}


YARN_CASES = [
    # base, scale, original_max_position, beta_fast, beta_slow
    (10000.0, 16.0, 4096, 32.0, 1.0),  # the seed's defaults
    (1000000.0, 4.0, 32768, 32.0, 1.0),  # Qwen-style
    (10000.0, 40.0, 4096, 32.0, 1.0),
    (10000.0, 8.0, 2048, 16.0, 2.0),
    (10000.0, 2.0, 4, 32.0, 1.0),  # at rotary_dim 32, low == high: the ramp's +0.001
    (10000.0, 0.5, 4096, 32.0, 1.0),  # scale <= 1: no mscale
    # base 10: beta_fast's correction falls inside the pairs and beta_slow's past
    # rotary_dim - 1, so the clamp of the ramp's top shapes the frequencies
    (10.0, 4.0, 1024, 32.0, 1.0),
]


@pytest.mark.parametrize("rotary_dim", (32, 64, 128))
@pytest.mark.parametrize("params", YARN_CASES, ids=str)
def test_yarn_matches_transformers(params, rotary_dim):
    base, scale, original, beta_fast, beta_slow = params
    config = _hf_config(
        rotary_dim, base, int(original * max(scale, 1)),
        dict(rope_type="yarn", factor=scale, original_max_position_embeddings=original,
             beta_fast=beta_fast, beta_slow=beta_slow),
    )  # fmt: skip
    hf = _hf("yarn", config)
    ours = YaRN(base, scale, original, beta_fast, beta_slow, 1.0)
    oracle = yarn_frequencies(rotary_dim, base, scale, original, beta_fast, beta_slow, 1.0)
    _check(ours, oracle, hf, rotary_dim)
    # attn_factor multiplies the amplitude (vLLM's mscale * attn_factor)
    scaled = YaRN(base, scale, original, beta_fast, beta_slow, 0.75)
    assert scaled.amplitude(rotary_dim) == pytest.approx(0.75 * hf[1], rel=1e-12)
    np.testing.assert_array_equal(scaled.inv_freq(rotary_dim), ours.inv_freq(rotary_dim))


@pytest.mark.parametrize("rotary_dim", (32, 96, 128))
@pytest.mark.parametrize(
    ("max_position", "original"), ((131072, 4096), (4096, 4096), (2048, 4096), (262144, 8192))
)
def test_longrope_matches_transformers(rng, max_position, original, rotary_dim):
    long_factor = rng.uniform(1.0, 60.0, rotary_dim // 2)
    short_factor = rng.uniform(0.9, 1.5, rotary_dim // 2)
    config = _hf_config(
        rotary_dim, 10000.0, max_position,
        dict(rope_type="longrope", long_factor=long_factor.tolist(),
             short_factor=short_factor.tolist(), original_max_position_embeddings=original),
    )  # fmt: skip
    for factors, seq_len in ((long_factor, original + 1), (short_factor, original)):
        hf = _hf("longrope", config, seq_len=seq_len)
        ours = LongRoPE(10000.0, factors, max_position, original)
        oracle = longrope_frequencies(rotary_dim, 10000.0, factors, max_position, original)
        _check(ours, oracle, hf, rotary_dim)
    if max_position > original:
        assert ours.amplitude(rotary_dim) > 1.01


def test_longrope_without_factors_is_standard():
    ours = LongRoPE(500000.0, None, 65536, 4096)
    np.testing.assert_array_equal(ours.inv_freq(64), Standard(500000.0).inv_freq(64))
    assert ours.amplitude(64) == pytest.approx(math.sqrt(1 + math.log(16) / math.log(4096)))


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", (0.0, -1.0, math.nan, math.inf, -math.inf))
@pytest.mark.parametrize("scheme", (Standard, Llama31, YaRN, LongRoPE))
def test_base_must_be_finite_and_positive(scheme, bad):
    with pytest.raises(ValueError, match="base"):
        scheme(base=bad)


@pytest.mark.parametrize(
    ("scheme", "kwargs", "name"),
    [
        (Llama31, {"scale_factor": 0.0}, "scale_factor"),
        (Llama31, {"scale_factor": -8.0}, "scale_factor"),
        (Llama31, {"low_freq_factor": math.nan}, "low_freq_factor"),
        (Llama31, {"high_freq_factor": math.inf}, "high_freq_factor"),
        (Llama31, {"low_freq_factor": 4.0, "high_freq_factor": 4.0}, "high_freq_factor"),
        (Llama31, {"low_freq_factor": 5.0, "high_freq_factor": 4.0}, "low_freq_factor"),
        (Llama31, {"original_max_position": 0}, "original_max_position"),
        (YaRN, {"scale": 0.0}, "scale"),
        (YaRN, {"scale": -2.0}, "scale"),
        (YaRN, {"beta_fast": 0.0}, "beta_fast"),
        (YaRN, {"beta_slow": math.nan}, "beta_slow"),
        (YaRN, {"attn_factor": 0.0}, "attn_factor"),
        (YaRN, {"original_max_position": -1}, "original_max_position"),
        (LongRoPE, {"max_position_embeddings": 0}, "max_position_embeddings"),
        (LongRoPE, {"original_max_position_embeddings": 0}, "original_max_position_embeddings"),
    ],
)
def test_bad_parameters_name_themselves(scheme, kwargs, name):
    with pytest.raises(ValueError, match=name) as error:
        scheme(**kwargs)
    assert any(repr(float(v)) in str(error.value) or str(v) in str(error.value)
               for v in kwargs.values())  # fmt: skip


def test_an_amplitude_beyond_float32_is_refused_by_the_ops():
    """A scheme's numbers may each be finite while its amplitude (YaRN: mscale * attn_factor)
    overflows the float32 tables: an op on it refuses it, naming it, where its table is made
    (the component when built; a seed op, whose rotary_dim comes with its input, at its
    first call)."""
    refused = r"amplitude of 1\.27\d*e\+39, beyond float32's range"
    with pytest.raises(ValueError, match=refused):
        RoPE(64, 4, 2, scheme=YaRN(attn_factor=1e39))
    op = YaRNFwdOp(attn_factor=1e39)
    with pytest.raises(ValueError, match=refused):
        op(np.ones((4, 64), np.float32))


@pytest.mark.parametrize("bad", (0.0, -0.0, math.nan, math.inf, -math.inf))
def test_longrope_bad_factors(bad):
    for container in (list, np.array, lambda v: torch.tensor(v, dtype=torch.float64), tuple):
        factors = [1.0] * 8
        factors[3] = bad
        with pytest.raises(ValueError, match=r"(?s)rescale_factors.*index \[3\]"):
            LongRoPE(rescale_factors=container(factors))


def test_longrope_factor_count_must_match_rotary_dim():
    scheme = LongRoPE(rescale_factors=[1.0] * 8)
    assert scheme.inv_freq(16).shape == (8,)
    with pytest.raises(ValueError, match=r"(?s)rescale_factors.*8"):
        scheme.inv_freq(64)


def test_equal_schemes_share_a_table_key():
    """Schemes are the tables' cache keys: equal parameters, however given, are equal keys."""
    factors = [1.0, 2.0, 3.0, 4.5]
    same = [
        LongRoPE(10000.0, factors, 8192, 4096),
        LongRoPE(10000, np.array(factors), 8192, 4096),
        LongRoPE(10000.0, torch.tensor(factors, dtype=torch.float64), 8192, 4096),
        LongRoPE(10000.0, tuple(factors), 8192, 4096),
    ]
    assert len({hash(s) for s in same}) == 1 and all(s == same[0] for s in same)
    assert LongRoPE(10000.0, [1.0, 2.0, 3.0, 4.0], 8192, 4096) != same[0]
    assert Standard(10000) == Standard(10000.0) and hash(Standard(10000)) == hash(Standard(1e4))
    assert Standard(10000.0) != Standard(10001.0)
    assert YaRN() != YaRN(attn_factor=0.5)
    with pytest.raises(AttributeError):
        Standard().base = 5.0  # frozen: a key cannot change under the table registry


@pytest.mark.parametrize("bad", (None, "abc", [2.0], {}))
@pytest.mark.parametrize(
    ("scheme", "name"),
    [(Standard, "base"), (Llama31, "scale_factor"), (YaRN, "scale"), (YaRN, "beta_fast"),
     (LongRoPE, "max_position_embeddings")],
)  # fmt: skip
def test_non_numbers_name_the_argument(scheme, name, bad):
    with pytest.raises(TypeError, match=rf"(?s)\b{name} must be a number.*{re.escape(repr(bad))}"):
        scheme(**{name: bad})


@pytest.mark.parametrize("original", (1,))  # 0.5 is no int: a TypeError (test_hardening)
def test_longrope_amplitude_needs_an_original_length_above_one(original):
    """``a = sqrt(1 + ln(s)/ln(original))`` is undefined at original <= 1 when s > 1: a
    ValueError at construction, not a ZeroDivisionError (or math domain error) later."""
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        LongRoPE(max_position_embeddings=8, original_max_position_embeddings=original)
    assert LongRoPE(max_position_embeddings=1, original_max_position_embeddings=1).amplitude(8) == 1
