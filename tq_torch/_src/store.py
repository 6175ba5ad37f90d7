"""Fused store: quantize K/V of new tokens and scatter them into their cache slots.

(`gluon_store` takes the mse presets' common case on sm_90: bfloat16 K/V at D = 128 with the
preset's default tables; `launch_store_kv` picks.)

Rows ``r`` = (token ``r // Hkv``, kv head ``r % Hkv``) are encoded
``BLOCK_R`` at a time; with contiguous inputs a tile is one contiguous chunk
of K and of V, read with 16-byte loads. A grid of resident programs (a few
per SM, from static shapes: CUDA-graph safe) loops over the row tiles, so the
rotation operand is loaded once per program and stays in shared memory, and
with PREFETCH the next tile's K/V loads are in flight while this one is
encoded. Per tile:

* mse keys: ``n = ||k||``; the rotation runs on tensor cores as
  ``Y = K @ Pi^T``. For tq_spec's rotations (``hadamard``,
  ``randomized_hadamard``) every entry of Pi is ``+-c``: the kernel
  multiplies by the exact +-1 sign matrix and scales by ``c / (n + 1e-8)``
  per row. The products are exact (bf16 and fp16 keys are dot operands as
  they are, fp32 keys are split into three bf16 parts whose sum is the key
  exactly) and accumulate in fp32, so codes equal the float64 reference's
  except at bucket boundaries, as the contract's tolerance allows. Any other
  rotation is split into three bf16 parts as well (six dots, about fp32
  accuracy). Codes come from a binary search over the midpoints
  (`bucketize`: ``bits - 1`` compares for tq_spec's symmetric codebooks).
* fp8 keys: saturate to +-448, round to nearest even, NaN kept: a hardware
  cast of the clamped key on the GPU (sm_89+, as the decode's fp8 cast), an
  exact integer encode in the interpreter (`kernel_math.fp8_e4m3fn_encode`).
* uniform values: ``lo``, ``hi``, ``scale = max((hi - lo) / (2**b - 1), 1e-8)``
  and ``code = clamp(floor((v - lo) / scale + 0.5), 0, 2**b - 1)`` with the
  correctly rounded fp32 quotient (one reciprocal per row, FMA corrections
  per element; the interpreter divides with ``div_rn``): the same bits as
  an IEEE fp32 division.
* raw presets: a 16-bit copy (rounded to the cache dtype when it differs).

Codes are packed in registers (pairwise merges, constant shifts) and every
field is written as one tile of 16-bit words per row (32-bit or 16-byte
stores where the slot stride allows), so a warp writes contiguous bytes. A
row whose slot is outside ``[0, N * P)`` (``-1`` = padding, or bad metadata)
is not written: every byte outside the named slots is left untouched. Cache
offsets are int64.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import numpy as np
import torch
import triton
import triton.language as tl

import tq_gluon.store
import tq_spec

from . import config, gluon_store, params
from .kernel_math import dot_operand, fp8_e4m3fn_encode, to_dtype_rne
from .launcher import KernelSite, kernel_site

NORM_EPS = tl.constexpr(1e-8)
VALUE_SCALE_MIN = tl.constexpr(1e-8)
_F32_MAX = tl.constexpr(3.4028234663852886e38)

# Rotation operand kinds (constexpr ROT_MODE).
ROT_SIGNS = 0  # Pi = c * S with S = +-1: S^T in the dot dtype, tensor-core dots, exact products
ROT_GENERAL = 1  # any Pi: float32 Pi, split into bf16 parts (six dots)

# Tile settings (GPU) at D=128 by key format (see `store_tiles`), chosen from
# the compiled code (registers, no spills), then swept on an H100 (T = 32k,
# Hkv 8, bf16 input; block_r 32/64/128, warps 4/8/16, programs_per_sm 1/2/4):
# mse 4-bit 159 us and 3-bit 269 us were best as they are (the next best 168 and
# 272 us with 8 warps); fp8 went 113 -> 105 us with block_r 32 at 4 programs
# per SM; raw stays at ~100 us (the copy bound) in every setting but block_r 128
# (141 us) and prefetch (212 us).
# `TUNING_OVERRIDES` replaces any setting, for tuning runs only (keys:
# "block_r", "num_warps", "programs_per_sm", "maxnreg", "num_stages", "rot_n",
# "prefetch"; then call `default_store_plan.cache_clear()`).
_TILES_D128 = {
    "mse": dict(block_r=64, num_warps=16, programs_per_sm=1, prefetch=True),
    "mse_general": dict(block_r=16, num_warps=4, programs_per_sm=2, prefetch=False),
    "fp8": dict(block_r=32, num_warps=8, programs_per_sm=4, prefetch=False),
    "raw": dict(block_r=64, num_warps=8, programs_per_sm=4, prefetch=False),
}
_INTERPRET_BLOCK_R = 16
TUNING_OVERRIDES: dict = {}


# --------------------------------------------------------------------------- device functions


@triton.jit
def _store_words(cache_i16_ptr, row_word, row_ok, word_idx, words, word_ok):
    """Writes int32 ``words [BR, W]`` (low 16 bits) at word ``row_word + word_idx`` of each row."""
    mask = row_ok[:, None] & word_ok[None, :]
    tl.store(cache_i16_ptr + row_word[:, None] + word_idx[None, :], words.to(tl.int16), mask=mask)


@triton.jit
def _pair_up(x, SHIFT: tl.constexpr):
    """``[BR, 2N]`` -> ``[BR, N]``: ``x[:, 2i] | x[:, 2i + 1] << SHIFT`` (a constant shift per pair)."""
    BR: tl.constexpr = x.shape[0]
    N2: tl.constexpr = x.shape[1]
    a, b = tl.split(tl.reshape(x, (BR, N2 // 2, 2)))
    return a | (b << SHIFT)


@triton.jit
def store_code_words(cache_i16_ptr, row_word, row_ok, codes, COL0: tl.constexpr, BITS: tl.constexpr,
                     N_CODES: tl.constexpr):
    """Packs ``codes [BR, NC]`` (int32, columns ``COL0 ..``) into the LSB-first ``BITS``-bit stream.

    ``row_word``: int64 word index of each row's stream start; columns at or
    past ``N_CODES`` are padding and not written (``N_CODES * BITS`` is a
    multiple of 16, so a word is wholly inside or past the stream). Codes are
    merged pairwise (neighbours first, each merge a constant shift): BITS 4
    and 8 reach 16-bit words, BITS 3 reaches 24-bit halves of a 16-code group
    (3 words).
    """
    if BITS == 3:
        BR: tl.constexpr = codes.shape[0]
        NG: tl.constexpr = codes.shape[1] // 16
        halves = _pair_up(_pair_up(_pair_up(codes, 3), 6), 12)  # [BR, 2 * NG], 24 bits each
        a, b = tl.split(tl.reshape(halves, (BR, NG, 2)))
        # A group's 48 bits are 3 words: a[0:16], a[16:24] | b[0:8] << 8, b[8:24], written as
        # 4-word runs (the 4th masked) so that a warp's lanes store consecutive words. Three
        # stores of one word per group left 6-byte gaps between lanes: H100, T = 32k, same
        # call, 3bit_nc 266 -> 145 us, k3v4_nc 184 -> 141 us (4bit_nc: 148). A join adds its
        # axis last, so the nested joins below read out as (a, middle word, b >> 8, b).
        words = tl.reshape(tl.join(tl.join(a, b >> 8), tl.join((a >> 16) | (b << 8), b)), (BR, 4 * NG))
        w = tl.arange(0, 4 * NG)
        word = (COL0 // 16 + w // 4) * 3 + w % 4
        _store_words(cache_i16_ptr, row_word, row_ok, word, words, (w % 4 < 3) & (word < N_CODES * 3 // 16))
    else:
        if BITS == 4:
            words = _pair_up(_pair_up(codes, 4), 8)
        else:
            tl.static_assert(BITS == 8, "code widths 3, 4 and 8")
            words = _pair_up(codes, 8)
        NW: tl.constexpr = words.shape[1]
        w = COL0 * BITS // 16 + tl.arange(0, NW)
        _store_words(cache_i16_ptr, row_word, row_ok, w, words, w < N_CODES * BITS // 16)


@triton.jit
def _min_nan(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _store_fp16_field(cache_i16_ptr, word, row_ok, x):
    """Stores fp32 ``x [BR]`` as little-endian fp16 (RNE) at word index ``word [BR]``."""
    tl.store(cache_i16_ptr + word, x.to(tl.float16).to(tl.int16, bitcast=True), mask=row_ok)


@triton.jit
def _search(y, mid_ptr, FIRST: tl.constexpr, LEVELS: tl.constexpr):
    """``#{j < 2**LEVELS - 1 : y >= mid[FIRST + j]}`` by binary search (ascending midpoints).

    ``LEVELS`` compares and a select tree over scalar midpoints instead of
    ``2**LEVELS - 1`` compares.
    """
    m = mid_ptr + FIRST
    if LEVELS == 4:
        b3 = y >= tl.load(m + 7)
        b2 = y >= tl.where(b3, tl.load(m + 11), tl.load(m + 3))
        t1 = tl.where(b3, tl.where(b2, tl.load(m + 13), tl.load(m + 9)),
                      tl.where(b2, tl.load(m + 5), tl.load(m + 1)))
        b1 = y >= t1
        t0 = tl.where(b3, tl.where(b2, tl.where(b1, tl.load(m + 14), tl.load(m + 12)),
                                   tl.where(b1, tl.load(m + 10), tl.load(m + 8))),
                      tl.where(b2, tl.where(b1, tl.load(m + 6), tl.load(m + 4)),
                               tl.where(b1, tl.load(m + 2), tl.load(m + 0))))
        b0 = y >= t0
        return (b3.to(tl.int32) << 3) | (b2.to(tl.int32) << 2) | (b1.to(tl.int32) << 1) | b0.to(tl.int32)
    elif LEVELS == 3:
        b2 = y >= tl.load(m + 3)
        b1 = y >= tl.where(b2, tl.load(m + 5), tl.load(m + 1))
        t0 = tl.where(b2, tl.where(b1, tl.load(m + 6), tl.load(m + 4)),
                      tl.where(b1, tl.load(m + 2), tl.load(m + 0)))
        b0 = y >= t0
        return (b2.to(tl.int32) << 2) | (b1.to(tl.int32) << 1) | b0.to(tl.int32)
    else:
        tl.static_assert(LEVELS == 2, "searches of 2..4 levels")
        b1 = y >= tl.load(m + 1)
        b0 = y >= tl.where(b1, tl.load(m + 2), tl.load(m + 0))
        return (b1.to(tl.int32) << 1) | b0.to(tl.int32)


@triton.jit
def bucketize(y, mid_ptr, BITS: tl.constexpr, MID_MODE: tl.constexpr):
    """``code = #{j : y >= mid[j]}`` (int32) over the ``2**BITS - 1`` midpoints; NaN gets code 0.

    MID_MODE 0: ascending and antisymmetric midpoints (``mid[H - 1] == 0``,
    ``mid[H - 1 + i] == -mid[H - 1 - i]``, ``H = 2**(BITS-1)``; every
    tq_spec codebook): one search over the upper half with ``|y|``. For
    ``y < 0`` the count is ``H - 1 - #{i : |y| > m_i}``, and ``|y| > m`` is
    ``pred(|y|) >= m`` with ``pred`` the next float down (bit pattern - 1),
    so the result is exactly the count. MID_MODE 1: ascending midpoints,
    a search over all of them. MID_MODE 2: any midpoints, a linear count.
    """
    if MID_MODE == 0:
        H: tl.constexpr = 1 << (BITS - 1)
        neg = y < 0.0
        nonneg = y >= 0.0  # -0.0 included; NaN is neither
        mag = (y.to(tl.int32, bitcast=True) & 0x7FFFFFFF) - neg.to(tl.int32)
        cnt = _search(mag.to(tl.float32, bitcast=True), mid_ptr, H, BITS - 1)
        return tl.where(nonneg, H + cnt, tl.where(neg, H - 1 - cnt, 0))
    elif MID_MODE == 1:
        return _search(y, mid_ptr, 0, BITS)
    else:
        code = tl.zeros(y.shape, dtype=tl.int32)
        for j in tl.static_range(0, (1 << BITS) - 1):
            code += (y >= tl.load(mid_ptr + j)).to(tl.int32)
        return code


@triton.jit
def _acc_dot(a, b, acc, INTERPRET: tl.constexpr):
    """``acc + a @ b`` in fp32; operands from `dot_operand` (16-bit floats on GPU, exact fp32 in the interpreter)."""
    if INTERPRET:
        return tl.dot(a, b, acc, input_precision="ieee", out_dtype=tl.float32)
    else:
        return tl.dot(a, b, acc, out_dtype=tl.float32)


@triton.jit
def _split3(x, INTERPRET: tl.constexpr):
    """fp32 ``x`` as three bf16 dot operands ``hi + mid + lo == x`` (8 significant bits each; exact)."""
    hi = dot_operand(x, tl.bfloat16, INTERPRET)
    rest = x - hi.to(tl.float32)
    mid = dot_operand(rest, tl.bfloat16, INTERPRET)
    lo = dot_operand(rest - mid.to(tl.float32), tl.bfloat16, INTERPRET)
    return hi, mid, lo


@triton.jit
def rotate_signs(k, kf, signs, IN_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """``K @ S`` for a +-1 matrix ``signs [D, N]`` (a dot operand, `load_rotation`): exact products, fp32 sums.

    16-bit keys are dot operands as they are (fp16 keys with fp16 signs); a
    float32 key is the exact sum of three bf16 parts, dotted smallest first.
    """
    acc = tl.zeros((k.shape[0], signs.shape[1]), dtype=tl.float32)
    if IN_DTYPE == tl.float16:
        acc = _acc_dot(dot_operand(kf, tl.float16, INTERPRET) if INTERPRET else k, signs, acc, INTERPRET)
    elif IN_DTYPE == tl.bfloat16:
        acc = _acc_dot(dot_operand(kf, tl.bfloat16, INTERPRET) if INTERPRET else k, signs, acc, INTERPRET)
    else:
        hi, mid, lo = _split3(kf, INTERPRET)
        acc = _acc_dot(lo, signs, acc, INTERPRET)
        acc = _acc_dot(mid, signs, acc, INTERPRET)
        acc = _acc_dot(hi, signs, acc, INTERPRET)
    return acc


@triton.jit
def rotate_general(kf, p_hi, p_mid, p_lo, INTERPRET: tl.constexpr):
    """``K @ Pi^T`` for any float32 ``Pi^T [D, N] = p_hi + p_mid + p_lo`` (`_split3`), to about fp32 accuracy.

    The key is split into three exact bf16 parts as well; the six products
    down to relative size 2**-16 are accumulated smallest first (the three
    dropped ones are 2**-24 and below, under fp32 rounding).
    """
    k_hi, k_mid, k_lo = _split3(kf, INTERPRET)
    acc = tl.zeros((kf.shape[0], p_hi.shape[1]), dtype=tl.float32)
    acc = _acc_dot(k_mid, p_mid, acc, INTERPRET)
    acc = _acc_dot(k_lo, p_hi, acc, INTERPRET)
    acc = _acc_dot(k_hi, p_lo, acc, INTERPRET)
    acc = _acc_dot(k_mid, p_hi, acc, INTERPRET)
    acc = _acc_dot(k_hi, p_mid, acc, INTERPRET)
    return _acc_dot(k_hi, p_hi, acc, INTERPRET)


@triton.jit
def div_by_row(x, s, inv_s, INTERPRET: tl.constexpr):
    """Correctly rounded ``x / s`` (fp32) for ``x [BR, W]``, ``s > 0`` per row, ``inv_s = RN(1/s)``.

    Two FMA residual corrections of ``x * inv_s`` (the fast path of
    ``div.rn.f32`` without its per-element reciprocal). Exact for the values
    a store meets: ``x >= 0`` and a normal scale; an infinite scale (span
    overflow) gives 0 or NaN as division does for the codes that follow.
    The interpreter divides directly (numpy's IEEE division).
    """
    if INTERPRET:
        return tl.math.div_rn(x, s[:, None] + tl.zeros_like(x))
    else:
        neg_s = (0.0 - tl.minimum(s, _F32_MAX))[:, None]  # per row: the FMAs take no negation
        r = inv_s[:, None]
        q = tl.fma(x, r, 0.0)
        q = tl.fma(tl.fma(q, neg_s, x), r, q)
        return tl.fma(tl.fma(q, neg_s, x), r, q)


@triton.jit
def _row_tile(tile, slot_ptr, n_rows, num_slots, stride_cn_w, stride_cp_w, stride_ch_w,
              HKV: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_R: tl.constexpr, SLOT_ALIGN_W: tl.constexpr):
    """Rows of this program: token and head (int64), whether each is written, cache word index of its slot.

    ``HKV`` and ``PAGE_SIZE`` are constexprs: a division by a runtime value
    costs tens of instructions, by a constant a multiply-shift, and Triton
    recomputes these row values in every register layout that uses them.
    """
    r = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = r < n_rows
    # Past-the-end rows read the last row (in bounds) and write nothing.
    r = tl.minimum(r, n_rows - 1)
    tok = r // HKV
    head = r - tok * HKV
    slot = tl.load(slot_ptr + tok)
    # Memory safety whatever the values: -1 (padding), other negatives and
    # slots >= N * P are not written (compared at the slot's own width, so an
    # int64 slot cannot wrap into range).
    ok = in_range & (slot >= 0) & (slot < num_slots)
    # In range, a slot fits in int32 (the launcher checks N * P < 2**31).
    slot = tl.where(ok, slot, 0).to(tl.int32)
    blk = slot // PAGE_SIZE
    in_blk = (slot - blk * PAGE_SIZE) * stride_cp_w + head * stride_ch_w
    word = blk.to(tl.int64) * stride_cn_w + in_blk.to(tl.int64)
    if SLOT_ALIGN_W > 1:
        # Every slot starts at a multiple of SLOT_ALIGN_W words (the strides' common
        # power of two): lets Triton widen the stores of contiguous fields.
        word = tl.multiple_of(word, SLOT_ALIGN_W)
    return tok.to(tl.int64), head.to(tl.int64), ok, word


@triton.jit
def _load_rows(ptr, row_off, D: tl.constexpr, D_PAD: tl.constexpr):
    """``[BR, D_PAD]`` rows at element offsets ``row_off`` (zeros past D)."""
    d = tl.arange(0, D_PAD)
    ptrs = ptr + row_off[:, None] + d[None, :]
    if D == D_PAD:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=(d < D)[None, :], other=0.0)


@triton.jit
def _store_raw(cache_i16_ptr, row_word, ok, x, RAW_DTYPE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
               INTERPRET: tl.constexpr):
    """Raw 16-bit copy of ``x [BR, D_PAD]`` (input dtype), rounded to RAW_DTYPE if it differs."""
    if x.dtype == RAW_DTYPE:
        bits = x.to(tl.int16, bitcast=True)
    else:
        bits = to_dtype_rne(x.to(tl.float32), RAW_DTYPE, INTERPRET).to(tl.int16, bitcast=True)
    d = tl.arange(0, D_PAD)
    mask = ok[:, None] & (d < D)[None, :]
    tl.store(cache_i16_ptr + row_word[:, None] + d[None, :], bits, mask=mask)


@triton.jit
def _fetch_tile(tile, key_ptr, value_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                stride_cn_w, stride_cp_w, stride_ch_w, n_rows, num_slots,
                D: tl.constexpr, D_PAD: tl.constexpr, HKV: tl.constexpr, PAGE_SIZE: tl.constexpr,
                BLOCK_R: tl.constexpr, SLOT_ALIGN_W: tl.constexpr):
    """Issues the loads of tile ``tile``: (rows written, their slot word index, K and V ``[BR, D_PAD]``)."""
    tok, head, ok, row_word = _row_tile(tile, slot_ptr, n_rows, num_slots, stride_cn_w, stride_cp_w, stride_ch_w,
                                        HKV, PAGE_SIZE, BLOCK_R, SLOT_ALIGN_W)
    k = _load_rows(key_ptr, tok * stride_kt + head * stride_kh, D, D_PAD)
    v = _load_rows(value_ptr, tok * stride_vt + head * stride_vh, D, D_PAD)
    return ok, row_word, k, v


@triton.jit
def _encode_tile(
    ok, row_word, k, v, cache_i16_ptr, rot_ptr, mid_ptr, rot_0, rot_1, rot_2, rot_scale,
    D: tl.constexpr, D_PAD: tl.constexpr,
    KEY_FORMAT: tl.constexpr, KEY_BITS: tl.constexpr, KEY_NORM_OFF: tl.constexpr,
    VALUE_FORMAT: tl.constexpr, VALUE_BITS: tl.constexpr, VALUE_OFF: tl.constexpr,
    VALUE_SCALE_OFF: tl.constexpr, VALUE_ZERO_OFF: tl.constexpr,
    RAW_DTYPE: tl.constexpr, IN_DTYPE: tl.constexpr, ROT_MODE: tl.constexpr, ROT_N: tl.constexpr,
    MID_MODE: tl.constexpr, ROT_RESIDENT: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Encodes the rows ``k``, ``v`` of one tile and writes the rows with ``ok`` set."""
    # ---- key part
    if KEY_FORMAT == 0:  # raw copy
        _store_raw(cache_i16_ptr, row_word, ok, k, RAW_DTYPE, D, D_PAD, INTERPRET)
    elif KEY_FORMAT == 1:  # fp8 e4m3fn, saturating
        store_code_words(cache_i16_ptr, row_word, ok,
                         fp8_e4m3fn_encode(k.to(tl.float32), not INTERPRET).to(tl.int32), 0, 8, D)
    else:  # rotated Lloyd-Max codes + fp16 norm (D is a power of two: D == D_PAD)
        kf = k.to(tl.float32)
        norm = tl.sqrt_rn(tl.sum(kf * kf, axis=1))
        # y = Pi @ k / (n + eps) = (K @ Pi^T) * (c / (n + eps)); c = 1 for a general Pi.
        row_scale = tl.math.div_rn(tl.zeros_like(norm) + rot_scale, norm + NORM_EPS)
        for c0 in tl.static_range(0, D, ROT_N):
            if not ROT_RESIDENT:
                rot_0, rot_1, rot_2 = load_rotation(rot_ptr, c0, ROT_MODE, D, ROT_N, IN_DTYPE, INTERPRET)
            if ROT_MODE == 0:
                acc = rotate_signs(k, kf, rot_0, IN_DTYPE, INTERPRET)
            else:
                acc = rotate_general(kf, rot_0, rot_1, rot_2, INTERPRET)
            y = acc * row_scale[:, None]
            codes = bucketize(y, mid_ptr, KEY_BITS, MID_MODE)
            store_code_words(cache_i16_ptr, row_word, ok, codes, c0, KEY_BITS, D)
        _store_fp16_field(cache_i16_ptr, row_word + KEY_NORM_OFF // 2, ok, norm)

    # ---- value part
    if VALUE_FORMAT == 0:
        _store_raw(cache_i16_ptr, row_word + VALUE_OFF // 2, ok, v, RAW_DTYPE, D, D_PAD, INTERPRET)
    else:
        LEVELS: tl.constexpr = (1 << VALUE_BITS) - 1
        vf = v.to(tl.float32)
        dmask = (tl.arange(0, D_PAD) < D)[None, :]
        # NaN-propagating, as the reference's min/max (and tq_jax's store): `tl.min`/`tl.max` skip NaN,
        # which turned a value vector holding a NaN into finite scale, zero and codes, a silent
        # wrong answer where the contract propagates the NaN. (min.NaN / max.NaN: same cost.)
        lo = tl.reduce(tl.where(dmask, vf, float("inf")), 1, _min_nan)
        hi = tl.reduce(tl.where(dmask, vf, float("-inf")), 1, _max_nan)
        scale = tl.maximum(tl.math.div_rn(hi - lo, tl.zeros_like(lo) + LEVELS * 1.0), VALUE_SCALE_MIN,
                           propagate_nan=tl.PropagateNan.ALL)
        inv_scale = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)
        pos = div_by_row(vf - lo[:, None], scale, inv_scale, INTERPRET) + 0.5
        # pos >= 0.5 and floor(pos) <= LEVELS for finite rows; NaN rows get 0
        # (the conversion's NaN result on the GPU; clamped in the interpreter).
        vcodes = tl.minimum(tl.floor(pos).to(tl.int32), LEVELS)
        if INTERPRET:
            vcodes = tl.maximum(vcodes, 0)
        store_code_words(cache_i16_ptr, row_word + VALUE_OFF // 2, ok, vcodes, 0, VALUE_BITS, D)
        _store_fp16_field(cache_i16_ptr, row_word + VALUE_SCALE_OFF // 2, ok, scale)
        _store_fp16_field(cache_i16_ptr, row_word + VALUE_ZERO_OFF // 2, ok, lo)


@triton.jit
def load_rotation(rot_ptr, c0: tl.constexpr, ROT_MODE: tl.constexpr, D: tl.constexpr, ROT_N: tl.constexpr,
                   IN_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """Rotation operands ``[D, ROT_N]`` for output columns ``c0 ..`` (three; unused ones are 0).

    ROT_MODE 0: the +-1 signs, stored in the dot dtype (``rot_ptr[j, i] =
    sign(Pi[i, j])``: fp16 for fp16 keys, else bf16). ROT_MODE 1: float32
    ``Pi^T`` split into three bf16 parts.
    """
    j = tl.arange(0, D)
    cols = c0 + tl.arange(0, ROT_N)
    if ROT_MODE == 0:
        signs = tl.load(rot_ptr + j[:, None] * D + cols[None, :])
        if INTERPRET:
            signs = signs.to(tl.float32)  # exact +-1; the interpreter's dots take fp32 operands
        return signs, 0, 0
    else:
        hi, mid, lo = _split3(tl.load(rot_ptr + cols[None, :] * D + j[:, None]), INTERPRET)
        return hi, mid, lo


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, cache_i16_ptr, slot_ptr, rot_ptr, mid_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cn_w, stride_cp_w, stride_ch_w,
    n_rows, num_slots, n_tiles, rot_scale,
    D: tl.constexpr, D_PAD: tl.constexpr,
    KEY_FORMAT: tl.constexpr, KEY_BITS: tl.constexpr, NORM_CORRECTION: tl.constexpr,
    KEY_NORM_OFF: tl.constexpr,
    VALUE_FORMAT: tl.constexpr, VALUE_BITS: tl.constexpr, VALUE_OFF: tl.constexpr,
    VALUE_SCALE_OFF: tl.constexpr, VALUE_ZERO_OFF: tl.constexpr,
    RAW_DTYPE: tl.constexpr, IN_DTYPE: tl.constexpr, ROT_MODE: tl.constexpr, ROT_N: tl.constexpr,
    MID_MODE: tl.constexpr, HKV: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_R: tl.constexpr,
    SLOT_ALIGN_W: tl.constexpr, PREFETCH: tl.constexpr, INTERPRET: tl.constexpr,
):
    # Resident programs loop over row tiles (grid <= tiles): the rotation
    # operand is loaded and converted once per program, and with PREFETCH the
    # next tile's K/V loads are in flight while this one is encoded.
    ROT_RESIDENT: tl.constexpr = KEY_FORMAT == 2 and D <= ROT_N
    if ROT_RESIDENT:
        rot_0, rot_1, rot_2 = load_rotation(rot_ptr, 0, ROT_MODE, D, ROT_N, IN_DTYPE, INTERPRET)
    else:
        rot_0, rot_1, rot_2 = 0, 0, 0
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    if PREFETCH:
        ok, row_word, k, v = _fetch_tile(pid, key_ptr, value_ptr, slot_ptr, stride_kt, stride_kh, stride_vt,
                                         stride_vh, stride_cn_w, stride_cp_w, stride_ch_w, n_rows, num_slots,
                                         D, D_PAD, HKV, PAGE_SIZE, BLOCK_R, SLOT_ALIGN_W)
    for tile in range(pid, n_tiles, step):
        if PREFETCH:
            cur_ok, cur_word, cur_k, cur_v = ok, row_word, k, v
            # The last round re-reads the last tile (in bounds, never written).
            nxt = tl.minimum(tile + step, n_tiles - 1)
            ok, row_word, k, v = _fetch_tile(nxt, key_ptr, value_ptr, slot_ptr, stride_kt, stride_kh, stride_vt,
                                             stride_vh, stride_cn_w, stride_cp_w, stride_ch_w, n_rows, num_slots,
                                             D, D_PAD, HKV, PAGE_SIZE, BLOCK_R, SLOT_ALIGN_W)
        else:
            cur_ok, cur_word, cur_k, cur_v = _fetch_tile(
                tile, key_ptr, value_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh, stride_cn_w,
                stride_cp_w, stride_ch_w, n_rows, num_slots, D, D_PAD, HKV, PAGE_SIZE, BLOCK_R, SLOT_ALIGN_W)
        _encode_tile(cur_ok, cur_word, cur_k, cur_v, cache_i16_ptr, rot_ptr, mid_ptr, rot_0, rot_1, rot_2, rot_scale,
                     D, D_PAD, KEY_FORMAT, KEY_BITS, KEY_NORM_OFF, VALUE_FORMAT, VALUE_BITS, VALUE_OFF,
                     VALUE_SCALE_OFF, VALUE_ZERO_OFF, RAW_DTYPE, IN_DTYPE, ROT_MODE, ROT_N, MID_MODE,
                     ROT_RESIDENT, INTERPRET)


# --------------------------------------------------------------------------- launcher


@functools.lru_cache(maxsize=None)
def _sign_form(rotation_bytes: bytes, d: int):
    """(``S^T`` float32 numpy, ``c``) if the float32 rotation is ``c * S`` with ``S = +-1``, else None."""
    rot = np.frombuffer(rotation_bytes, dtype=np.float32).reshape(d, d)
    c = float(abs(rot[0, 0]))
    if not (np.isfinite(c) and c > 0 and np.all(np.abs(rot) == np.float32(c))):
        return None
    return np.ascontiguousarray(np.where(rot > 0, 1.0, -1.0).astype(np.float32).T), c


def _signs_tensor(signs_t: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The +-1 operand in the kernel's dot dtype (fp16 for fp16 keys, else bf16): exact."""
    return torch.from_numpy(signs_t).to(device=device, dtype=torch.float16 if dtype == torch.float16 else torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _default_forms(preset_name: str, d: int):
    """tq_spec's default rotation and codebook: (``S^T``, ``c``, midpoint mode); numpy, cached."""
    qp = tq_spec.quant_params(preset_name, d)
    signs_t, c = _sign_form(np.ascontiguousarray(qp.rotation, dtype=np.float32).tobytes(), d)
    return signs_t, c, _midpoint_form(np.asarray(qp.codebook.midpoints, np.float32))


def rotation_operand(preset_name: str, d: int, rotation: torch.Tensor, key_dtype: torch.dtype):
    """(operand tensor, rot_scale, ROT_MODE) for the kernel's rotation.

    tq_spec's default rotation (recognised by identity with the cached tensor,
    no device sync) and any +-c rotation on the CPU take the sign path; other
    device rotations take the general path (`rotate_general`).
    """
    dev = rotation.device
    if rotation is params.default_rotation(preset_name, d, dev):
        signs_t, c, _ = _default_forms(preset_name, d)
        op_dtype = torch.float16 if key_dtype == torch.float16 else torch.bfloat16
        tensor = params._cached(("store_rotation_signs_t", d, str(dev), str(op_dtype)),
                                lambda: _signs_tensor(signs_t, key_dtype, dev))
        return tensor, c, ROT_SIGNS
    if dev.type == "cpu":
        form = _sign_form(rotation.detach().to(torch.float32).contiguous().numpy().tobytes(), d)
        if form is not None:
            return _signs_tensor(form[0], key_dtype, dev), form[1], ROT_SIGNS
    return rotation.to(torch.float32).contiguous(), 1.0, ROT_GENERAL


MID_SYMMETRIC, MID_SORTED, MID_ANY = 0, 1, 2


def _midpoint_form(mid: np.ndarray) -> int:
    """MID_SYMMETRIC / MID_SORTED / MID_ANY for float32 midpoints (see `bucketize`)."""
    n = mid.size
    if n < 3 or not np.all(np.diff(mid) > 0):
        return MID_ANY
    if mid[n // 2] == 0 and np.array_equal(mid, -mid[::-1]):
        return MID_SYMMETRIC
    return MID_SORTED


def midpoint_mode(preset_name: str, d: int, midpoints: torch.Tensor) -> int:
    """How `bucketize` may search ``midpoints``, decided without a device sync.

    tq_spec's default codebook (recognised by identity with the cached
    tensor) and CPU tensors are inspected; other device tensors get the
    linear count, which needs no ordering.
    """
    dev = midpoints.device
    if midpoints is params.default_midpoints(preset_name, d, dev):
        return _default_forms(preset_name, d)[2]
    if dev.type == "cpu":
        return _midpoint_form(midpoints.detach().to(torch.float32).numpy())
    return MID_ANY


def store_tiles(d_pad: int, key_format: int, rot_mode: int, in_bytes: int, interpret: bool) -> dict:
    """Launch settings for one head dim, key format and input width (plus `TUNING_OVERRIDES`).

    ``block_r`` rows per tile, ``num_warps``, ``programs_per_sm`` resident
    programs per SM (the grid is that many per SM; each loops over tiles),
    ``maxnreg`` (default: the register share that lets ``programs_per_sm``
    programs fit on an SM), ``prefetch`` (next tile's loads in flight during
    this one), ``num_stages`` (Triton's pipeliner), ``rot_n`` (output columns
    per rotation dot; the rotation operand stays in shared memory across
    tiles when ``rot_n == D``).
    """
    rot_n = d_pad if d_pad <= 256 else 128
    if interpret:
        return dict(block_r=_INTERPRET_BLOCK_R, num_warps=4, num_stages=1, rot_n=rot_n, maxnreg=None,
                    programs_per_sm=1, prefetch=True)
    kind = {config.KEY_MSE: "mse", config.KEY_FP8: "fp8"}.get(key_format, "raw")
    if kind == "mse" and rot_mode == ROT_GENERAL:
        kind = "mse_general"
    tiles = dict(dict(num_stages=1, rot_n=min(rot_n, 128), maxnreg=None), **_TILES_D128[kind])
    if kind == "mse_general":
        # Three bf16 parts of a [D, rot_n] slice of Pi in shared memory: <= 96 KiB.
        tiles["rot_n"] = min(d_pad, 16384 // d_pad)
        if d_pad > 128:
            tiles.update(num_warps=8, programs_per_sm=1)  # the three key parts of wide heads
    # Same elements per program at other head dims (at least the 16 rows of a dot).
    tiles["block_r"] = max(16, tiles["block_r"] * 128 // d_pad)
    if kind == "fp8" and (d_pad > 128 or in_bytes > 2):
        tiles.update(programs_per_sm=2)  # 64 registers spill there (compiled code); 128 do not
    if kind == "mse":
        # Register budget (from the compiled code): wider rotation operands
        # and three key parts for fp32 keys want fewer, fatter threads.
        tiles["rot_n"] = rot_n
        if d_pad > 128 or in_bytes > 2:
            tiles.update(prefetch=False)
        if in_bytes > 2 or d_pad > 256:
            tiles.update(num_warps=8)
        if in_bytes > 2 and d_pad > 128:
            tiles.update(block_r=16)  # still spills (fp32 keys at D >= 256 are rare in a store)
        if d_pad > 256:
            tiles.update(rot_n=32)
    tiles.update(TUNING_OVERRIDES)
    if tiles["maxnreg"] is None:
        share = 65536 // (32 * tiles["num_warps"] * tiles["programs_per_sm"])
        tiles["maxnreg"] = min(255, share // 8 * 8)
    return tiles


def _max_programs(device: torch.device, interpret: bool, tiles: dict) -> int:
    """Programs of the tile loop: resident ones only (static: CUDA-graph safe); 2 in the interpreter (exercises the loop)."""
    if interpret:
        return 2
    return tiles["programs_per_sm"] * config.sm_count(device)


def _slot_align_words(strides: tuple) -> int:
    """The largest power of two (<= 8) dividing every slot's word offset: the cache strides' common factor."""
    g = 0
    for st in strides[:3]:
        g = math.gcd(g, st // 2)
    return min(8, g & -g) if g else 1


class StorePlan(NamedTuple):
    """What a store launch needs besides its tensors and T (`store_plan`)."""

    site: KernelSite  # `_store_kv_kernel` with its constexprs
    rotation: Optional[torch.Tensor]  # the rotation operand (`rotation_operand`); None: not read
    rotation_scale: float
    midpoints: Optional[torch.Tensor]  # None: not read
    block_r: int  # rows (token, head) per tile
    max_programs: int


def store_plan(preset_name: str, key_dtype: torch.dtype, head_dim: int, cache_shape: tuple,
               cache_strides: tuple, device: torch.device, rotation: Optional[torch.Tensor],
               midpoints: Optional[torch.Tensor]) -> StorePlan:
    """The `StorePlan` of a cache and key dtype; ``rotation``/``midpoints`` None: the preset's defaults."""
    n, p, hkv, _ = cache_shape
    d = head_dim
    lay = tq_spec.layout(preset_name, d)
    fmt = config.format_constexprs(lay)
    interpret = config.interpreted(device)
    rot = mid = None
    rot_scale, rot_mode, mid_mode = 1.0, ROT_SIGNS, MID_ANY
    if fmt["KEY_FORMAT"] == config.KEY_MSE:
        rotation = rotation if rotation is not None else params.default_rotation(preset_name, d, device)
        mid = midpoints if midpoints is not None else params.default_midpoints(preset_name, d, device)
        rot, rot_scale, rot_mode = rotation_operand(preset_name, d, rotation, key_dtype)
        mid_mode = midpoint_mode(preset_name, d, mid)
    d_pad = config.padded_head_dim(d)
    tiles = store_tiles(d_pad, fmt["KEY_FORMAT"], rot_mode, key_dtype.itemsize, interpret)
    site = kernel_site(_store_kv_kernel, dict(
        D_PAD=d_pad, IN_DTYPE=config.TORCH_TO_TL[key_dtype], ROT_MODE=rot_mode, ROT_N=tiles["rot_n"],
        MID_MODE=mid_mode, PREFETCH=tiles["prefetch"], SLOT_ALIGN_W=_slot_align_words(cache_strides),
        HKV=hkv, PAGE_SIZE=p, BLOCK_R=tiles["block_r"], INTERPRET=interpret, num_warps=tiles["num_warps"],
        maxnreg=tiles["maxnreg"], num_stages=tiles["num_stages"],
        **fmt,
    ))
    return StorePlan(site, rot, rot_scale, mid, tiles["block_r"], _max_programs(device, interpret, tiles))


@functools.lru_cache(maxsize=256)
def default_store_plan(preset_name: str, key_dtype: torch.dtype, head_dim: int, cache_shape: tuple,
                       cache_strides: tuple, device: torch.device) -> StorePlan:
    """`store_plan` with the preset's default tables, cached per static signature.

    Eager decode steps store a few tokens per call, where this host work is
    most of the call. Clear it (``cache_clear()``) after changing `TUNING_OVERRIDES`.
    """
    return store_plan(preset_name, key_dtype, head_dim, cache_shape, cache_strides, device, None, None)


@functools.lru_cache(maxsize=256)
def _takes_gluon(preset_name: str, key_dtype: torch.dtype, value_dtype: torch.dtype, head_dim: int,
                 device: torch.device) -> bool:
    """Whether a store with the preset's default tables runs `gluon_store` (`gluon_store.ineligible`)."""
    return gluon_store.ineligible(preset_name, key_dtype=key_dtype, value_dtype=value_dtype, head_dim=head_dim,
                                  device=device, default_tables=True) is None


def launch_store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, preset_name: str, rotation: torch.Tensor | None,
                    midpoints: torch.Tensor | None) -> None:
    """Runs the store kernel (in place on ``kv_cache``); arguments already validated.

    ``rotation`` float32 ``[D, D]`` and ``midpoints`` float32 ``[2**bits - 1]``
    (ascending, as in every `tq_spec.Codebook`) on the cache's device, or None for the
    preset's defaults; read by mse presets only. ``slot_mapping`` must be
    contiguous; slots outside ``[0, N * P)`` are skipped.
    """
    t, hkv, d = key.shape
    if t == 0:
        return
    shape, strides, dev = kv_cache.shape, kv_cache.stride(), kv_cache.device
    n_rows = t * hkv
    n, p = shape[:2]
    if n * p >= 2**31 or n_rows >= 2**31:
        raise NotImplementedError(f"kv_cache: {n * p} slots / {n_rows} rows; the store addresses fewer than 2**31")
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    defaults = rotation is None and midpoints is None
    if defaults and tq_gluon.store.ENABLED and _takes_gluon(preset_name, key.dtype, value.dtype, d, dev):
        gluon_store.launch(gluon_store.store_plan(preset_name, hkv, p, dev), key, value, kv_cache, slot_mapping)
        return
    if defaults:
        plan = default_store_plan(preset_name, key.dtype, d, shape, strides, dev)
    else:
        plan = store_plan(preset_name, key.dtype, d, shape, strides, dev, rotation, midpoints)
    n_tiles = -(-n_rows // plan.block_r)
    # Dummies for tables a format never reads: any tensor will do.
    rot = plan.rotation if plan.rotation is not None else slot_mapping
    mid = plan.midpoints if plan.midpoints is not None else slot_mapping
    plan.site((min(n_tiles, plan.max_programs),),
              (key, value, kv_cache.view(torch.int16), slot_mapping, rot, mid),  # 2-byte fields: even offsets
              (key.stride(0), key.stride(1), value.stride(0), value.stride(1),
               strides[0] // 2, strides[1] // 2, strides[2] // 2, n_rows, n * p, n_tiles, plan.rotation_scale))
