"""The in-kernel codecs of tq_jax against tq_spec's exact numpy ones.

The element-wise codecs run inside a Pallas kernel on the active backend
(interpret mode on CPU, Triton on a GPU), since that is where they must agree
bit for bit with the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

import tq_spec
from tq_jax._src import kernel_math as km
from tq_jax._src.platform import interpret_default, pallas_kwargs

_BLOCK = 1024
DTYPES_16 = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


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
        in_specs=[spec] * len(arrays), out_specs=spec,
        **pallas_kwargs(interpret=None, name="kernel_math_probe", num_warps=4),
    )(*arrays)
    return np.asarray(out)[:n]


@pytest.mark.parametrize("hardware", [False, True], ids=["integer", "cast"])
def test_fp8_encode_matches_spec_on_every_fp16_and_random_fp32(hardware, fp8_encode_inputs):
    """Both encodes (the store picks the cast on sm_89+) give the reference's bits on
    `fp8_encode_inputs` (every float16, wide random float32, subnormals, the edges)."""
    x = fp8_encode_inputs
    fn = lambda v: km.fp8_e4m3fn_encode(v, hardware=hardware)  # noqa: E731
    got = _elementwise_in_kernel(fn, x, out_dtype=jnp.int32)
    np.testing.assert_array_equal(got, tq_spec.fp8_e4m3fn_encode(x).astype(np.int32))


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


@pytest.mark.parametrize("name,ptx", [("float16", False), ("float16", True), ("bfloat16", False)],
                         ids=["float16", "float16-ptx", "bfloat16"])
def test_half_fields_match_spec_bits(name, ptx):
    """Every float16, wide random float32 and the edges; ``ptx``: the store's PTX conversion on a
    GPU (`f32_to_half_bits(use_ptx=True)`; interpret mode keeps the integer recipe)."""
    use_ptx = ptx and not interpret_default()
    rng = np.random.default_rng(1)
    x = np.concatenate([
        np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32),
        (rng.standard_normal(1 << 16) * np.exp2(rng.integers(-30, 20, 1 << 16))).astype(np.float32),
        np.array([65504.0, 65520.0, 1e10, -1e10, 2.0**-24, 2.0**-25, 1.5 * 2.0**-24, 3e-8, 0.0, -0.0], np.float32),
    ])
    bits = _elementwise_in_kernel(lambda v: km.f32_to_half_bits(v, name, use_ptx=use_ptx), x,
                                  out_dtype=jnp.int32)
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


def test_exp2_in_kernel():
    """The softmax exponent, exact at the edges the online softmax meets (-inf -> 0, 0 -> 1,
    NaN -> NaN), and within 2 ulp scaled by max(1, |x|): XLA's CPU exp2 (interpret mode) is
    exp(x ln 2), whose error grows with |x|; PTX ex2.approx on a GPU (H100) met the same bound."""
    rng = np.random.default_rng(3)
    edges = [-np.inf, 0.0, np.nan, -1.0, -0.5]
    x = np.concatenate([rng.uniform(-120.0, 0.0, 1 << 14), edges]).astype(np.float32)
    use_ptx = not interpret_default()
    got = _elementwise_in_kernel(lambda v: km.exp2(v, use_ptx=use_ptx), x, out_dtype=jnp.float32)
    want = np.exp2(x.astype(np.float64))
    np.testing.assert_array_equal(got[-5:-3], [0.0, 1.0])
    assert np.isnan(got[-3])
    rel = np.abs(got[:-5] / want[:-5] - 1.0)
    bound = 2.0**-22 * np.maximum(1.0, np.abs(x[:-5]))
    assert np.all(rel <= bound), (x[:-5][rel > bound][:4], rel[rel > bound][:4])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_biased_nibble_operand_on_every_word(name):
    """The value decode's PTX nibble pairs (`biased_nibble_operand`, GPU only): every 16-bit word
    gives its four codes ORed with the bias bits, in element order, bit for bit."""
    from tq_jax._src.kv_tiles import _BIASED_CODE_BITS

    bias_bits, _ = _BIASED_CODE_BITS[name]
    dtype = jnp.dtype(name)
    words = np.random.default_rng(4).permutation(1 << 16).astype(np.int32).reshape(1024, 64)

    def kernel(w_ref, o_ref):
        o_ref[...] = km.biased_nibble_operand(w_ref[...], dtype, bias_bits)

    got = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((1024, 256), dtype), grid=(1024 // 16,),
        in_specs=[pl.BlockSpec((16, 64), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((16, 256), lambda i: (i, 0)),
        **pallas_kwargs(interpret=None, name="kernel_math_probe", num_warps=4),
    )(jnp.asarray(words))
    codes = (words[:, :, None] >> (4 * np.arange(4))) & 0xF  # element 4i + j: field j of word i
    want = (codes | bias_bits).astype(np.uint16).reshape(1024, 256)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want)


def _in_kernel_2d(fn, x, out_shape, out_dtype):
    """``fn(x)`` for a small 2-D int32 array inside one Pallas program (interpret mode on CPU)."""

    def kernel(x_ref, o_ref):
        o_ref[...] = fn(x_ref[...]).astype(o_ref.dtype)

    return np.asarray(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype),
                                     **pallas_kwargs(interpret=None, name="kernel_math_probe", num_warps=4))(jnp.asarray(x)))


@pytest.mark.parametrize("bits", [3, 4])
def test_code_unpacking_from_bytes_matches_spec(bits):
    """The attention kernels' unpack (shifts of 16-bit words for 4 bits, byte planes for 3) in element order."""
    rng = np.random.default_rng(bits)
    n, d = 16, 64
    codes = rng.integers(0, 1 << bits, (n, d)).astype(np.uint8)
    packed = tq_spec.pack_bits(codes, bits).astype(np.int32)  # [n, d * bits / 8]
    if bits == 4:
        fn = lambda w: km.codes_from_words(w, 4)  # noqa: E731
        x = packed[:, 0::2] | (packed[:, 1::2] << 8)
    else:
        x = packed.reshape(n, d // 8, 3).transpose(0, 2, 1).reshape(n, 3 * d // 8)  # the 3 planes side by side
        g = d // 8

        def fn(b):
            planes = [jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, (n, 3, g), 1) == i,
                                        b.reshape(n, 3, g), 0), axis=1) for i in range(3)]
            return km.codes_from_byte_planes(*planes)

    np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(x))), codes)
    if bits == 4:  # the join + reshape also inside a kernel (Triton on a GPU)
        np.testing.assert_array_equal(_in_kernel_2d(fn, x, (n, d), jnp.int32), codes)


def test_word_fields_give_the_codes_and_code_pairs():
    """`unmasked_fields` leaves the higher bits in place (a shuffle reads only the low 5; the
    decode's lane table repeats every 16 lanes): masked to 4 bits they are the codes, and the
    8-bit split is the byte pairs (the float32 pair-table index)."""
    rng = np.random.default_rng(7)
    n, d = 16, 128
    codes = rng.integers(0, 16, (n, d)).astype(np.uint8)
    packed = tq_spec.pack_bits(codes, 4).astype(np.int32)
    w = packed[:, 0::2] | (packed[:, 1::2] << 8)
    f0, f1, f2, f3 = (np.asarray(f) for f in km.unmasked_fields(jnp.asarray(w), 4, 4))
    np.testing.assert_array_equal(np.asarray(km.interleave(f0, f2)) & 15, codes[:, 0::2])
    np.testing.assert_array_equal(np.asarray(km.interleave(f1, f3)) & 15, codes[:, 1::2])
    np.testing.assert_array_equal(f0, w)  # nothing masked: the shuffle index is the word itself
    np.testing.assert_array_equal(np.asarray(km.codes_from_words(jnp.asarray(w), 8)), packed)
    np.testing.assert_array_equal(np.asarray(km.words_to_bytes(jnp.asarray(w))), packed)
    with pytest.raises(ValueError, match="4 or 8 bits"):
        km.codes_from_words(jnp.asarray(w), 3)


def test_bytes_to_words_and_interleave():
    rng = np.random.default_rng(5)
    b = rng.integers(0, 256, (16, 64)).astype(np.int32)
    want = b[:, 0::2] | (b[:, 1::2] << 8)
    np.testing.assert_array_equal(np.asarray(km.bytes_to_words(jnp.asarray(b))), want)
    np.testing.assert_array_equal(_in_kernel_2d(km.bytes_to_words, b, (16, 32), jnp.int32), want)
    lo, hi = jnp.asarray(b[:, :32]), jnp.asarray(b[:, 32:])
    inter = np.asarray(km.interleave(lo, hi))
    np.testing.assert_array_equal(inter[:, 0::2], b[:, :32])
    np.testing.assert_array_equal(inter[:, 1::2], b[:, 32:])


def test_fp8_bytes_to_float_is_exact_on_all_bytes():
    codes = np.arange(256, dtype=np.int32)
    want = tq_spec.fp8_e4m3fn_decode(codes.astype(np.uint8))
    for dt in (jnp.float32, jnp.bfloat16, jnp.float16):
        got = _elementwise_in_kernel(lambda c, dt=dt: km.fp8_bytes_to_float(c, dt).astype(jnp.float32), codes,
                                     out_dtype=jnp.float32)
        np.testing.assert_array_equal(got, want)  # NaN where the spec says NaN


@pytest.mark.parametrize("c", [1, 3, 5, 16, 48])
def test_nonnegative_div_and_rem(c):
    x = np.arange(0, 5000, 7, dtype=np.int32)
    np.testing.assert_array_equal(np.asarray(km.div_nonneg(jnp.asarray(x), c)), x // c)
    np.testing.assert_array_equal(np.asarray(km.rem_nonneg(jnp.asarray(x), c)), x % c)


@pytest.mark.parametrize("bits,dtype", [(4, "bfloat16"), (4, "float32"), (3, "float16"), (3, "float32")])
def test_key_tables(bits, dtype):
    from tq_jax._src.kv_tiles import key_tables

    cents = np.zeros(16, np.float32)
    cents[: 1 << bits] = np.random.default_rng(bits).standard_normal(1 << bits).astype(np.float32) * 0.1
    tab = np.asarray(key_tables(jnp.asarray(cents), bits, dtype, True))
    assert tab.shape == (3, 1 << (2 * bits))
    if dtype == "float32":  # pair tables
        i = np.arange(1 << (2 * bits))
        lo, hi = cents[i & ((1 << bits) - 1)], cents[i >> bits]
        np.testing.assert_array_equal(tab[0].view(np.float32), lo)
        np.testing.assert_array_equal(tab[1].view(np.float32), hi)
        np.testing.assert_array_equal(tab[2].view(np.float32), lo * lo + hi * hi)
        return
    # Per-code entries: the centroid in the compute dtype, its scaled fp16 square above it.
    c = cents[: 1 << bits]
    r = tab[1].view(np.float32)
    assert np.all(r == r[0]) and np.log2(r[0]) == np.round(np.log2(r[0]))
    assert 1.0 <= r[0] * np.abs(c).max() < 2.0
    entry = tab[0, : 1 << bits]
    half = np.dtype(DTYPES_16[dtype])
    np.testing.assert_array_equal((entry & 0xFFFF).astype(np.uint16).view(half), c.astype(half))
    np.testing.assert_array_equal((entry >> 16).astype(np.uint16).view(np.float16),
                                  np.square(r[0] * c).astype(np.float16))
    assert not tab[0, 1 << bits:].any() and not tab[2].any()
