"""Element-wise helpers used inside Pallas kernels (and valid in plain jnp).

Everything here is written with operations the Pallas Triton lowering accepts:
integer shifts with clamped, in-range amounts, same-width bitcasts, `jnp.where`
selects (never multiplication by a 0/1 mask, which turns NaN garbage into NaN
results), iotas instead of captured array constants, and reshapes only.
The small-float codecs are exact integer recipes, so interpret mode (XLA CPU)
and the GPU produce the same bits, and neither depends on how a backend casts
to fp8 (the Triton interpreter, torch and ml_dtypes disagree on overflow and
carries; see DESIGN.md section 7).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltriton

FP8_MAX = 448.0
_FP8_MIN_NORMAL = 2.0**-6
# f32 exponent bias (127) minus fp8 e4m3 bias (7), in the position of the
# combined (exponent << 3 | mantissa) fp8 field.
_FP8_REBIAS = (127 - 7) << 3


def fp8_e4m3fn_encode(x, hardware: bool = False):
    """float32 -> int32 fp8 e4m3fn bit patterns (0..255), like `tq_spec.fp8_e4m3fn_encode`.

    Rounds to nearest even, saturates to +-448, keeps NaN as NaN (0x7F with the
    sign bit of the input). Exact for every float32 input.

    ``hardware``: a float8_e4m3fn cast of the input clamped to +-448 (on the GPU, sm_89+, the
    round-to-nearest-even ``cvt.rn.satfinite.e4m3x2.f32``: one instruction per two elements; in
    interpret mode XLA's rounding convert), NaN set apart. Else the integer recipe (about
    twenty instructions per element; any compute capability).
    """
    x = x.astype(jnp.float32)
    bits = lax.bitcast_convert_type(x, jnp.int32)
    sign = lax.shift_right_logical(bits, 31)
    is_nan = x != x
    if hardware:
        # Clamped first: saturation does not rest on the convert's overflow rule (XLA's gives NaN).
        code = lax.bitcast_convert_type(jnp.clip(x, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), jnp.uint8)
        return jnp.where(is_nan, 0x7F | (sign << 7), code.astype(jnp.int32))
    mag = jnp.minimum(jnp.abs(jnp.where(is_nan, 0.0, x)), FP8_MAX)
    mbits = lax.bitcast_convert_type(mag, jnp.int32)
    # Normal range: keep exponent and the top 3 mantissa bits, round the other
    # 20 bits half to even; a carry runs into the exponent, as it should.
    top = lax.shift_right_logical(mbits, 20)
    rest = mbits & 0xFFFFF
    half = 0x80000
    round_up = (rest > half) | ((rest == half) & ((top & 1) == 1))
    normal = top - _FP8_REBIAS + round_up.astype(jnp.int32)
    # Subnormal range: multiples of 2**-9 (the scaling by 512 is exact).
    y = mag * 512.0
    r = jnp.floor(y)
    frac = y - r
    ri = r.astype(jnp.int32)
    sub_up = (frac > 0.5) | ((frac == 0.5) & ((ri & 1) == 1))
    subnormal = ri + sub_up.astype(jnp.int32)
    code = jnp.where(mag >= _FP8_MIN_NORMAL, normal, subnormal)
    code = jnp.where(is_nan, 0x7F, code)
    return code | (sign << 7)


def fp8_e4m3fn_decode(code):
    """int32 fp8 e4m3fn bit patterns (0..255) -> float32 (NaN for 0x7F/0xFF)."""
    code = code.astype(jnp.int32)
    e = lax.shift_right_logical(code, 3) & 0xF
    m = code & 0x7
    # Normal: (1 + m/8) * 2**(e-7) built directly as float32 bits.
    normal = lax.bitcast_convert_type(((e + 120) << 23) | (m << 20), jnp.float32)
    subnormal = m.astype(jnp.float32) * (2.0**-9)
    mag = jnp.where(e == 0, subnormal, normal)
    mag = jnp.where((code & 0x7F) == 0x7F, jnp.nan, mag)
    return jnp.where((code & 0x80) != 0, -mag, mag)


def half_bits_to_f32(word, dtype_name: str = "float16"):
    """int32/uint16 16-bit patterns -> float32, reading them as fp16 or bf16."""
    dtype = jnp.float16 if dtype_name == "float16" else jnp.bfloat16
    return lax.bitcast_convert_type(word.astype(jnp.uint16), dtype).astype(jnp.float32)


def f32_to_half_bits(x, dtype_name: str = "float16", *, use_ptx: bool = False):
    """float32 -> int32 holding the fp16/bf16 bit pattern (round to nearest even).

    Integer recipes instead of a float cast: on the GPU, Triton's packed
    f32 -> bf16 conversion feeding a bitcast gave wrong low bytes (seen on an
    H200 with jax 0.11.2), and the integer form is exact on every backend.
    NaN stays a quiet NaN (with the input's sign); overflow goes to +-inf.
    ``use_ptx`` (fp16, kernels lowered for a GPU): PTX ``cvt.rn.f16.f32`` of each
    element into a 32-bit register (no packed conversion), the same bits as the recipe
    in three instructions instead of about thirty.
    """
    x = x.astype(jnp.float32)
    bits = lax.bitcast_convert_type(x, jnp.int32)
    sign = lax.shift_right_logical(bits, 16) & 0x8000
    mag = bits & 0x7FFFFFFF
    is_nan = mag > 0x7F800000
    if use_ptx and dtype_name == "float16":
        [half] = pltriton.elementwise_inline_asm(
            "{ .reg .b16 h;\n cvt.rn.f16.f32 h, $1;\n cvt.u32.u16 $0, h; }",
            args=[x], constraints="=r,f", pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.int32)],
        )
        return jnp.where(is_nan, sign | 0x7E00, half)
    if dtype_name == "bfloat16":
        lsb = lax.shift_right_logical(mag, 16) & 1
        half = lax.shift_right_logical(mag + 0x7FFF + lsb, 16)
        half = jnp.where(is_nan, lax.shift_right_logical(mag, 16) | 0x40, half)
        return sign | half
    # fp16: rebias the exponent (127 -> 15), keep 10 mantissa bits, round the other 13.
    exp = lax.shift_right_logical(mag, 23) - 112
    top = (exp << 10) | (lax.shift_right_logical(mag, 13) & 0x3FF)
    rest = mag & 0x1FFF
    up = (rest > 0x1000) | ((rest == 0x1000) & ((top & 1) == 1))
    normal = jnp.minimum(top + up.astype(jnp.int32), 0x7C00)  # a carry into exponent 31 is inf
    # Subnormal fp16 (|x| < 2**-14): multiples of 2**-24; the scaling by 2**24 is exact.
    y = jnp.abs(x) * 16777216.0
    r = jnp.floor(y)
    frac = y - r
    ri = r.astype(jnp.int32)
    sub = ri + ((frac > 0.5) | ((frac == 0.5) & ((ri & 1) == 1))).astype(jnp.int32)
    half = jnp.where(exp >= 1, normal, sub)
    half = jnp.where(exp >= 31, 0x7C00, half)
    half = jnp.where(is_nan, 0x7E00, half)
    return sign | half


def unpack_codes(lo_word, hi_word, element, bits: int):
    """Codes of an LSB-first `bits`-bit stream from the 16-bit words that hold them.

    Args:
      lo_word: int32 word holding bit ``element*bits`` (word ``element*bits // 16``).
      hi_word: the next word (read only for widths that may straddle words), or None.
      element: int32 element indices (same shape).
    """
    shift = (element * bits) & 15
    word = lo_word
    if hi_word is not None:
        word = word | (hi_word << 16)
    return lax.shift_right_logical(word, shift) & ((1 << bits) - 1)


def codes_straddle_words(bits: int) -> bool:
    """Whether a `bits`-bit code can span two 16-bit words."""
    return 16 % bits != 0


def pack_code_groups(codes, bits: int):
    """Packs codes into 16-bit words, groups of 16 codes -> `bits` words.

    Args:
      codes: int32 ``[n]`` with ``n`` a multiple of 16, values in ``[0, 2**bits)``.

    Returns:
      a list of `bits` int32 arrays ``[n // 16]``: entry ``j`` holds word ``j``
      of every group, i.e. stream word ``g * bits + j`` for group ``g``.
    """
    n = codes.shape[0]
    groups = codes.reshape(n // 16, 16)
    lane = lax.broadcasted_iota(jnp.int32, (1, 16), 1)
    words = []
    for j in range(bits):
        # Bit position of each code relative to the start of word j.
        shift = lane * bits - 16 * j
        left = jnp.clip(shift, 0, 15)
        right = jnp.clip(-shift, 0, 15)
        overlaps = (shift < 16) & (shift > -bits)
        part = (lax.shift_left(lax.shift_right_logical(groups, right), left)) & 0xFFFF
        words.append(jnp.sum(jnp.where(overlaps, part, 0), axis=1))
    return words


def interleave(a, b):
    """``[..., W]`` x 2 -> ``[..., 2W]`` with `a` in the even and `b` in the odd columns.

    `jnp.stack` on the last axis lowers to ``tt.join``, which adds the new axis
    inside one thread's registers, so the reshape moves no data (tq_torch's
    ``_interleave`` is the same join + reshape).
    """
    *lead, w = a.shape
    return jnp.stack([a, b], axis=-1).reshape(*lead, 2 * w)


def interleave_fields(fields):
    """Element order from ``2**k`` bit fields: ``fields[j] [..., G]`` holds element ``j`` of each
    group of ``n = len(fields)`` consecutive elements -> ``[..., n * G]``.

    Recursive even/odd interleave: the even-numbered fields make the even
    columns, so no transpose is needed.
    """
    if len(fields) == 1:
        return fields[0]
    return interleave(interleave_fields(fields[0::2]), interleave_fields(fields[1::2]))


def bytes_to_words(x):
    """Little-endian byte pairs ``[..., 2W]`` (uint8/int32) -> int32 16-bit words ``[..., W]``.

    The pair axis stays inside a thread (``tt.split``), so this is two
    register operations per word.
    """
    *lead, n = x.shape
    lo, hi = jnp.unstack(x.astype(jnp.int32).reshape(*lead, n // 2, 2), axis=-1)
    return lo | (hi << 8)


def words_to_bytes(w):
    """int32 16-bit words ``[..., W]`` -> int32 bytes ``[..., 2W]``, little-endian (inverse of `bytes_to_words`)."""
    return interleave(w & 0xFF, lax.shift_right_logical(w, 8))


def group_words(a, b, c):
    """int32 24-bit little-endian words ``a | b << 8 | c << 16`` of three byte planes ``[..., G]``
    (the 3-bit streams: 8 codes in 3 bytes)."""
    return a.astype(jnp.int32) | (b.astype(jnp.int32) << 8) | (c.astype(jnp.int32) << 16)


def unmasked_fields(w, bits: int, count: int):
    """The `count` ``bits``-wide fields of int32 words ``w``, each *unmasked*: ``w >> bits * j``
    (the bits above a field are left in place). A consumer that reads only the low bits (a warp
    shuffle's lane index) or masks once itself saves the AND per element."""
    return [w if j == 0 else lax.shift_right_logical(w, bits * j) for j in range(count)]


def codes_from_words(w, bits: int):
    """int32 codes ``[..., 16 W / bits]`` in element order from 16-bit words ``[..., W]`` (4 or 8 bits)."""
    if bits == 8:
        return words_to_bytes(w)
    if bits == 4:
        return interleave_fields([x & 0xF for x in unmasked_fields(w, 4, 4)])
    raise ValueError(f"codes_from_words: 4 or 8 bits, got {bits}")


def codes_from_byte_planes(a, b, c):
    """3-bit codes ``[..., 8G]`` from the three byte planes of groups of 8 codes (3 bytes each).

    ``a, b, c [..., G]``: bytes ``3g``, ``3g + 1``, ``3g + 2`` of the field;
    together a 24-bit little-endian word whose field ``j`` is element ``8g + j``.
    """
    return interleave_fields([x & 7 for x in unmasked_fields(group_words(a, b, c), 3, 8)])


# 4-bit codes -> 16-bit ``BITS | code`` pairs, two 32-bit registers per 16-bit word (elements
# 4i .. 4i+3 of word i): each pair is the word's two nibbles moved into place by one shift, masked
# and ORed with the bias bits (tq_torch's ``_NIBBLE_PAIRS``).
_NIBBLE_PAIRS = (
    "{ .reg .b32 t; shl.b32 t, $2, 12; or.b32 t, t, $2; and.b32 t, t, 0x000F000F; or.b32 $0, t, BIAS; "
    "shr.b32 t, $2, 8; shl.b32 $1, $2, 4; or.b32 t, t, $1; and.b32 t, t, 0x000F000F; or.b32 $1, t, BIAS; }")


def biased_nibble_operand(words, dtype, bias_bits: int):
    """GPU only. int32 16-bit words ``[..., W]`` of 4-bit codes -> `dtype` ``[..., 4W]`` (bfloat16 or
    float16) whose element ``4i + j`` has the bits ``bias_bits | code_j(word i)``.

    What ``codes_from_words(words, 4) | bias_bits`` read as `dtype` gives, two elements per
    instruction group instead of a shift, mask and permute per element. Each word is repeated
    four times (joins: no data moves) so that one asm pack of four elements reads it.
    """
    *lead, w = words.shape
    w2 = jnp.stack([words, words], axis=-1).reshape(*lead, 2 * w)  # (Pallas' Triton stack takes two)
    w4 = jnp.stack([w2, w2], axis=-1).reshape(*lead, 4 * w)
    asm = _NIBBLE_PAIRS.replace("BIAS", hex(bias_bits * 0x10001))
    [x] = pltriton.elementwise_inline_asm(
        asm, args=[w4], constraints="=r,=r,r,r,r,r", pack=4,
        result_shape_dtypes=[jax.ShapeDtypeStruct(w4.shape, dtype)])
    return x


def fp8_bytes_to_float(x, dtype):
    """fp8 e4m3fn bytes (uint8) -> `dtype` through a same-width bitcast and a hardware convert.

    Exact for every byte (e4m3fn fits fp16, bf16 and fp32); 0x7F/0xFF are NaN.
    One conversion per element instead of `fp8_e4m3fn_decode`'s integer recipe.
    """
    return lax.bitcast_convert_type(x.astype(jnp.uint8), jnp.float8_e4m3fn).astype(dtype)


def half_words_to_float(word, dtype_name: str, dtype):
    """16-bit patterns (int32) read as fp16/bf16 (`dtype_name`), converted to `dtype`; elements
    already of that float type (`CacheWords.load_halves` on a float view) are only converted."""
    half = jnp.float16 if dtype_name == "float16" else jnp.bfloat16
    if jnp.issubdtype(word.dtype, jnp.floating):
        if word.dtype != jnp.dtype(half):
            raise TypeError(f"word: expected {jnp.dtype(half).name} elements or int32 patterns, got {word.dtype}")
        x = word
    else:
        x = lax.bitcast_convert_type(word.astype(jnp.uint16), half)
    return x if jnp.dtype(dtype) == jnp.dtype(half) else x.astype(dtype)


def ieee_div(a, b, *, use_ptx: bool):
    """Correctly rounded float32 ``a / b`` on every backend.

    Triton lowers float32 division to PTX ``div.full.f32`` (up to 2 ulp off);
    with ``use_ptx`` (kernels lowered for a GPU) the quotient comes from
    ``div.rn.f32`` instead, the IEEE division that interpret mode (XLA CPU)
    and numpy perform. Keeps store codes/fp16 fields equal to the reference
    away from bucket boundaries and the fp32 attention output tight.
    Scalars and arrays alike; the two operands broadcast.
    """
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    if not use_ptx:
        return a / b
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    vec = shape if shape else (1,)
    a = jnp.broadcast_to(a, vec)
    b = jnp.broadcast_to(b, vec)
    [q] = pltriton.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(vec, jnp.float32)],
    )
    return q if shape else q.reshape(())


def exp2(x, *, use_ptx: bool):
    """``2 ** x`` for float32 `x`: PTX ``ex2.approx.ftz.f32`` (one MUFU.EX2) with ``use_ptx``
    (kernels lowered for a GPU), else `jnp.exp2`.

    The softmax's exponent (tq_torch's `tl.exp2`): an approximation of a few ulp, -inf -> 0, NaN -> NaN;
    results below 2**-126 flush to 0 (they vanish next to the row's largest term, which is 1).
    """
    x = jnp.asarray(x, jnp.float32)
    if not use_ptx:
        return jnp.exp2(x)
    vec = x.shape if x.shape else (1,)
    [y] = pltriton.elementwise_inline_asm(
        "ex2.approx.ftz.f32 $0, $1;", args=[jnp.broadcast_to(x, vec)], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(vec, jnp.float32)],
    )
    return y if x.shape else y.reshape(())


def div_nonneg(x, c: int):
    """``x // c`` for non-negative int32 `x` and a static ``c >= 1``: a shift when ``c`` is a power
    of two (jnp's floor division of signed integers costs a few extra instructions per element)."""
    if c & (c - 1) == 0:
        return lax.shift_right_logical(x, jnp.asarray(c.bit_length() - 1, x.dtype))
    return lax.div(x, jnp.asarray(c, x.dtype))


def rem_nonneg(x, c: int):
    """``x % c`` for non-negative int32 `x` and a static ``c >= 1`` (a mask for powers of two)."""
    if c & (c - 1) == 0:
        return x & jnp.asarray(c - 1, x.dtype)
    return lax.rem(x, jnp.asarray(c, x.dtype))


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a, b):
    """Ceiling division for Python ints and int32 arrays alike."""
    return (a + b - 1) // b


def lane_table_entry(entries, shape, like=None):
    """GPU only. ``int32 shape``, every element holding ``entries[lane % len(entries)]`` for the lane
    (of the warp) that holds it; ``entries``: int32 scalars or Python ints, a power of two <= 32 of
    them.

    Built from the lane id by a select chain: every element of a thread gets the same value from
    the same operands, so the compiler keeps one register per thread and hoists it out of loops;
    no memory is read per element. ``like``: an int32 ``shape`` tile of the loop body to feed the
    lane-id asm (else zeros). With constant entries every operand is then loop-variant or a
    constant, which lets Triton move a layout conversion of the dot operands this entry feeds back
    onto ``like`` (a tile defined outside the loop stops that); ptxas still computes the chain once
    per thread.
    """
    [lane] = pltriton.elementwise_inline_asm(
        "mov.u32 $0, %laneid;", args=[jnp.zeros(shape, jnp.int32) if like is None else like],
        constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.int32)])
    lane = lane & (len(entries) - 1)
    entry = jnp.full(shape, entries[0], jnp.int32)
    for k in range(1, len(entries)):
        entry = jnp.where(lane == k, entries[k], entry)
    return entry


def shuffle_lookup(index, entry):
    """GPU only. int32 ``entry`` of lane ``index & 31`` for each element (`lane_table_entry`).

    One warp shuffle per element, no memory access. All 32 lanes of the warp must run it (no
    divergence). (One 32-bit result per element: jax 0.10's Pallas lowering rejects a
    multi-result inline asm ("2 outvars do not match 1 outvals"), so tq_torch's
    shuffle-and-permute pair asm is left to the compiler's byte permutes here.)
    """
    [e] = pltriton.elementwise_inline_asm(
        "shfl.sync.idx.b32 $0, $2, $1, 0x1f, 0xffffffff;", args=[index, entry], constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(index.shape, jnp.int32)])
    return e
