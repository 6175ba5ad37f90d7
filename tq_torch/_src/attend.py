"""Device functions shared by the attention kernels: page addressing, K/V tile
dequantisation and the online-softmax loop over a key range.

Conventions (both kernels):
* A tile of ``BLOCK_M`` rows serves several query heads of one GQA group (and,
  when it fits, several query tokens): row ``r`` is token ``r // G``, group
  head ``r % G``. Every K/V element is dequantised once per tile and used by
  all its rows through ``tl.dot``.
* Scores live in the log2 domain (``s * log2(e)``) so the softmax uses exp2;
  ``m`` (running max) is -inf until a row sees a key, guarded so -inf - -inf
  never produces NaN.
* Loads of keys outside ``[k_lo, k_hi)`` are masked (pages the sequence does
  not own are never touched), and the dequantised V tile is zeroed with
  ``tl.where`` on invalid keys so garbage (NaN/Inf) bytes cannot reach P @ V as
  ``0 * NaN``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tl_math import dot, dot_operand, tanh_f32

LOG2E = tl.constexpr(1.4426950408889634)  # jit code may only read constexpr globals


@triton.jit
def slot_byte_offsets(bt_ptr, bt_row, keys, key_valid, kv_head, stride_cn, stride_cp, stride_ch,
                      page_size):
    """int64 byte offset of the slot of each key position (``keys [BN]``) of one sequence."""
    # Page size is a runtime value (one compiled kernel serves every page
    # size); the division is per key, not per element.
    page = keys // page_size
    blk = tl.load(bt_ptr + bt_row + page, mask=key_valid, other=0).to(tl.int64)
    return blk * stride_cn + (keys - page * page_size).to(tl.int64) * stride_cp + kv_head * stride_ch


@triton.jit
def unpack_codes(cache_u8, field_base, d, mask, BITS: tl.constexpr):
    """Codes ``[BN, D_PAD]`` of an LSB-first ``BITS``-bit stream starting at ``field_base [BN]``.

    A code may straddle two bytes when BITS does not divide 8; the second byte
    is then read too (it lies inside the slot: a field always follows).
    """
    bit = d * BITS
    byte = (bit >> 3)[None, :]
    shift = (bit & 7)[None, :]
    addr = field_base[:, None] + byte
    word = tl.load(cache_u8 + addr, mask=mask, other=0).to(tl.int32)
    if (8 % BITS) != 0:
        straddle = mask & ((shift + BITS) > 8)
        word = word | (tl.load(cache_u8 + addr + 1, mask=straddle, other=0).to(tl.int32) << 8)
    return (word >> shift) & ((1 << BITS) - 1)


@triton.jit
def load_fp16_field(cache_i16, byte_offset, mask):
    """fp16 field (little-endian, even offset) -> fp32; 0 where masked."""
    bits = tl.load(cache_i16 + byte_offset // 2, mask=mask, other=0)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def load_key_tile(cache_u8, cache_i16, cb_ptr, slot, key_valid, d,
                  D: tl.constexpr, KEY_FORMAT: tl.constexpr, KEY_BITS: tl.constexpr,
                  NORM_CORRECTION: tl.constexpr, KEY_NORM_OFF: tl.constexpr, RAW_DTYPE: tl.constexpr):
    """Keys in scoring space: ``(k [BN, D_PAD] fp32, per-key factor [BN] fp32)``.

    score = factor * (q . k). Raw/fp8 keys: factor 1. mse keys: ``k`` holds the
    gathered centroids and factor is ``norm`` (``norm / ||c||`` with norm
    correction), so the per-key scaling is one multiply after the dot.
    """
    mask = key_valid[:, None] & (d < D)[None, :]
    if KEY_FORMAT == 0:
        bits = tl.load(cache_i16 + (slot // 2)[:, None] + d[None, :], mask=mask, other=0)
        k = bits.to(RAW_DTYPE, bitcast=True).to(tl.float32)
        factor = tl.full(key_valid.shape, 1.0, tl.float32)
    elif KEY_FORMAT == 1:
        b8 = tl.load(cache_u8 + slot[:, None] + d[None, :], mask=mask, other=0)
        k = b8.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        factor = tl.full(key_valid.shape, 1.0, tl.float32)
    else:
        codes = unpack_codes(cache_u8, slot, d, mask, KEY_BITS)
        k = tl.load(cb_ptr + codes)
        factor = load_fp16_field(cache_i16, slot + KEY_NORM_OFF, key_valid)
        if NORM_CORRECTION:
            factor = tl.math.div_rn(factor, tl.sqrt_rn(tl.sum(k * k, axis=1)))
    return k, factor


@triton.jit
def load_value_tile(cache_u8, cache_i16, slot, key_valid, d,
                    D: tl.constexpr, VALUE_FORMAT: tl.constexpr, VALUE_BITS: tl.constexpr,
                    VALUE_OFF: tl.constexpr, VALUE_SCALE_OFF: tl.constexpr,
                    VALUE_ZERO_OFF: tl.constexpr, RAW_DTYPE: tl.constexpr):
    """Values ``[BN, D_PAD]`` fp32 (``code * scale16 + zero16``); exactly 0 on invalid keys."""
    mask = key_valid[:, None] & (d < D)[None, :]
    if VALUE_FORMAT == 0:
        bits = tl.load(cache_i16 + ((slot + VALUE_OFF) // 2)[:, None] + d[None, :], mask=mask, other=0)
        v = bits.to(RAW_DTYPE, bitcast=True).to(tl.float32)
    else:
        codes = unpack_codes(cache_u8, slot + VALUE_OFF, d, mask, VALUE_BITS).to(tl.float32)
        scale = load_fp16_field(cache_i16, slot + VALUE_SCALE_OFF, key_valid)
        zero = load_fp16_field(cache_i16, slot + VALUE_ZERO_OFF, key_valid)
        v = codes * scale[:, None] + zero[:, None]
    # where, not multiply: a garbage scale/zero/raw value may be NaN or Inf.
    return tl.where(mask, v, 0.0)


@triton.jit
def attend_key_range(
    q, acc, m_i, l_i, pos, row_valid, k_lo, k_hi,
    bt_ptr, bt_row, kv_head, cache_u8, cache_i16, cb_ptr,
    stride_cn, stride_cp, stride_ch, page_size, sm_scale, softcap, window,
    BLOCK_N: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    KEY_FORMAT: tl.constexpr, KEY_BITS: tl.constexpr, NORM_CORRECTION: tl.constexpr,
    KEY_NORM_OFF: tl.constexpr, VALUE_FORMAT: tl.constexpr, VALUE_BITS: tl.constexpr,
    VALUE_OFF: tl.constexpr, VALUE_SCALE_OFF: tl.constexpr, VALUE_ZERO_OFF: tl.constexpr,
    RAW_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Online softmax of rows ``q [BLOCK_M, D_PAD]`` over keys ``[k_lo, k_hi)`` of one sequence.

    ``pos [BLOCK_M]``: each row's absolute query position; key ``j`` is visible
    iff ``j <= pos`` (and ``j > pos - window`` when ``window > 0``);
    ``softcap > 0`` enables the soft cap. Both are runtime scalars (uniform
    branches): one compiled kernel serves every masking variant. Returns the
    updated ``(acc [BLOCK_M, D_PAD], m_i, l_i)`` (unnormalised, log2 domain).
    """
    d = tl.arange(0, D_PAD)
    for start in range(k_lo, k_hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_valid = keys < k_hi
        slot = slot_byte_offsets(bt_ptr, bt_row, keys, key_valid, kv_head,
                                 stride_cn, stride_cp, stride_ch, page_size)
        k, k_factor = load_key_tile(cache_u8, cache_i16, cb_ptr, slot, key_valid, d,
                                    D, KEY_FORMAT, KEY_BITS, NORM_CORRECTION, KEY_NORM_OFF, RAW_DTYPE)
        s = dot(q, tl.trans(dot_operand(k, DOT_DTYPE, INTERPRET)), DOT_DTYPE, INTERPRET)
        s = s * (k_factor * sm_scale)[None, :]
        if softcap > 0:
            # On the scaled logits, before masking (DESIGN.md section 3).
            s = softcap * tanh_f32(s / softcap)
        s = s * LOG2E
        visible = key_valid[None, :] & row_valid[:, None] & (keys[None, :] <= pos[:, None])
        if window > 0:
            visible = visible & (keys[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = load_value_tile(cache_u8, cache_i16, slot, key_valid, d, D, VALUE_FORMAT, VALUE_BITS,
                            VALUE_OFF, VALUE_SCALE_OFF, VALUE_ZERO_OFF, RAW_DTYPE)
        pv = dot(dot_operand(p, DOT_DTYPE, INTERPRET), dot_operand(v, DOT_DTYPE, INTERPRET),
                 DOT_DTYPE, INTERPRET)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def load_query_rows(q_ptr, q_tok, q_head, row_valid, stride_qt, stride_qh, d,
                    D: tl.constexpr, DOT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """Query rows ``[BLOCK_M, D_PAD]`` as dot operands (0 in padding rows / lanes)."""
    ptrs = q_ptr + q_tok.to(tl.int64)[:, None] * stride_qt + q_head.to(tl.int64)[:, None] * stride_qh \
        + d[None, :]
    q = tl.load(ptrs, mask=row_valid[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
    return dot_operand(q, DOT_DTYPE, INTERPRET)
