"""The in-kernel codecs of tq_jax against tq_spec's exact numpy ones.

The element-wise codecs run inside a Pallas kernel on the active backend
(interpret mode on CPU, Triton on a GPU), since that is where they must agree
bit for bit with the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import tq_spec
from tq_jax._src import kernel_math as km
from tq_jax._src.platform import interpret_default, pallas_kwargs

_BLOCK = 1024


def _elementwise_in_kernel(fn, *arrays, out_dtype):
    """Applies `fn` to 1-D arrays (length a multiple of 1024) inside a Pallas kernel."""
    n = arrays[0].shape[0]
    pad = -n % _BLOCK
    arrays = [jnp.pad(jnp.asarray(a), (0, pad)) for a in arrays]

    def kernel(*refs):
        *ins, out = refs
        out[...] = fn(*[r[...] for r in ins]).astype(out.dtype)

    spec = pl.BlockSpec((_BLOCK,), lambda i: (i,))
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((n + pad,), out_dtype), grid=((n + pad) // _BLOCK,),
        in_specs=[spec] * len(arrays), out_specs=spec, **pallas_kwargs(interpret=None, num_warps=4),
    )(*arrays)
    return np.asarray(out)[:n]


def test_fp8_encode_matches_spec_on_every_fp16_and_random_fp32():
    every_half = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    rng = np.random.default_rng(0)
    wide = (rng.standard_normal(1 << 16) * np.exp2(rng.integers(-20, 12, 1 << 16))).astype(np.float32)
    special = np.array([1.9747, -1.9747, 448.0, 449.0, 464.0, 480.0, 1000.0, -1e30, 2.0**-9, 2.0**-10,
                        1.5 * 2.0**-9, 2.5 * 2.0**-9, 2.0**-6 - 2.0**-12, 0.0, -0.0], np.float32)
    x = np.concatenate([every_half, wide, special])
    finite = np.isfinite(x)
    got = _elementwise_in_kernel(km.fp8_e4m3fn_encode, x, out_dtype=jnp.int32).astype(np.uint8)
    want = tq_spec.fp8_e4m3fn_encode(np.clip(x, -448.0, 448.0))
    np.testing.assert_array_equal(got[finite], want[finite])
    assert np.all((got[np.isnan(x)] & 0x7F) == 0x7F)  # NaN stays NaN


def test_fp8_decode_matches_spec_on_all_bytes():
    codes = np.arange(256, dtype=np.int32)
    got = _elementwise_in_kernel(km.fp8_e4m3fn_decode, codes, out_dtype=jnp.float32)
    np.testing.assert_array_equal(got, tq_spec.fp8_e4m3fn_decode(codes.astype(np.uint8)))


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("n", [16, 64, 512])
def test_pack_and_unpack_match_spec_bit_stream(bits, n):
    rng = np.random.default_rng(bits * 1000 + n)
    codes = rng.integers(0, 1 << bits, n).astype(np.int32)
    words = km.pack_code_groups(jnp.asarray(codes), bits)
    stream = np.zeros(n * bits // 16, np.int64)
    for j, w in enumerate(words):
        stream[j::bits] = np.asarray(w)
    packed = tq_spec.pack_bits(codes.astype(np.uint8), bits)
    np.testing.assert_array_equal(stream, packed[0::2].astype(np.int64) | (packed[1::2].astype(np.int64) << 8))
    # Unpack from the words, reading the next word only for straddling widths.
    e = np.arange(n)
    w = np.concatenate([stream, [0]])
    lo = jnp.asarray(w[(e * bits) >> 4].astype(np.int32))
    hi = jnp.asarray(w[((e * bits) >> 4) + 1].astype(np.int32)) if km.codes_straddle_words(bits) else None
    np.testing.assert_array_equal(np.asarray(km.unpack_codes(lo, hi, jnp.asarray(e, jnp.int32), bits)), codes)


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_half_fields_match_spec_bits(name):
    rng = np.random.default_rng(1)
    x = np.concatenate([
        np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32),
        (rng.standard_normal(1 << 16) * np.exp2(rng.integers(-30, 20, 1 << 16))).astype(np.float32),
        np.array([65504.0, 65520.0, 1e10, -1e10, 2.0**-24, 2.0**-25, 1.5 * 2.0**-24, 3e-8, 0.0, -0.0], np.float32),
    ])
    bits = _elementwise_in_kernel(lambda v: km.f32_to_half_bits(v, name), x, out_dtype=jnp.int32)
    with np.errstate(over="ignore"):
        b = (tq_spec.fp16_bytes if name == "float16" else tq_spec.bf16_bytes)(x)
    want_bits = b[..., 0].astype(np.int32) | (b[..., 1].astype(np.int32) << 8)
    nan = np.isnan(x)  # NaN payloads may differ; NaN must stay NaN
    np.testing.assert_array_equal(bits[~nan], want_bits[~nan])
    back = _elementwise_in_kernel(lambda w: km.half_bits_to_f32(w, name), bits, out_dtype=jnp.float32)
    with np.errstate(over="ignore"):
        want = tq_spec.round_to_fp16(x) if name == "float16" else tq_spec.round_to_bf16(x)
    np.testing.assert_array_equal(back, want)  # equal_nan: NaN decodes to NaN


def test_ieee_div_in_kernel_is_correctly_rounded():
    rng = np.random.default_rng(2)
    a = rng.standard_normal(1 << 14).astype(np.float32)
    b = (rng.random(1 << 14) + 0.1).astype(np.float32) * np.float32(3.0)
    use_ptx = not interpret_default()
    got = _elementwise_in_kernel(lambda x, y: km.ieee_div(x, y, use_ptx=use_ptx), a, b, out_dtype=jnp.float32)
    np.testing.assert_array_equal(got, a / b)
