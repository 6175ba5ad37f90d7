"""In-kernel reading of key/value tiles from the paged, quantized cache.

Shared by the decode and extend kernels. A tile is `block_n` consecutive token
positions of one sequence and one kv head. Addresses are always computed from
positions clamped into ``[0, seq_len)``, so a program only ever reads slots of
pages its sequence's block table names (never a page past ``seq_len``, never a
block-table entry the sequence does not use). Positions outside the range the
caller may attend are then zeroed with `jnp.where` (not multiplied by 0), so
NaN/Inf garbage in out-of-window or unused slots cannot reach the output.

Keys come back in *scoring space*: for mse presets ``n * c_hat[code]`` in the
rotated basis (pair with ``q_rot = Pi @ q``), otherwise the key itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from jax import lax

from tq_spec import Layout

from . import kernel_math as km
from .cache_access import CacheWords, WordFields


@dataclass(frozen=True)
class TileSpec:
    """Static description of the tiles one kernel reads."""

    lay: Layout
    fields: WordFields
    access: CacheWords
    block_size: int  # P, tokens per page
    block_n: int  # tokens per tile (power of two >= 16)
    head_dim_padded: int  # power of two >= head_dim
    ptx_div: bool  # IEEE division through PTX (GPU lowering); plain `/` in interpret mode

    @property
    def head_dim(self) -> int:
        return self.lay.head_dim


def load_kv_tile(spec: TileSpec, cache_ref, bt_ref, cb_ref, b, kv_head, start, seq_len, keep_key):
    """Dequantized ``(K, V)`` float32 ``[block_n, head_dim_padded]`` for positions ``start + i``.

    Args:
      cb_ref: centroid table ref (mse presets) or None.
      b, kv_head, start, seq_len: int32 scalars; requires ``seq_len >= 1``.
      keep_key: bool ``[block_n]``: positions some query row may attend; every
        other row of the tile, and lanes ``>= head_dim``, are exactly 0.
    """
    lay, f, acc = spec.lay, spec.fields, spec.access
    p = lay.preset
    bn, dp, d = spec.block_n, spec.head_dim_padded, spec.head_dim
    pos = start + lax.broadcasted_iota(jnp.int32, (bn,), 0)
    pos = jnp.clip(pos, 0, seq_len - 1)
    blk = bt_ref[b, pos // spec.block_size]
    off = pos % spec.block_size
    blk2, off2 = blk[:, None], off[:, None]
    lane = lax.broadcasted_iota(jnp.int32, (1, dp), 1)
    lane_c = jnp.minimum(lane, d - 1)
    keep = keep_key[:, None] & (lane < d)

    def words(word):
        return acc.load(cache_ref, blk2, off2, kv_head, word)

    def token_field(word):  # one 16-bit field per token -> [bn]
        return acc.load(cache_ref, blk, off, kv_head, word)

    def codes(word0, bits):
        bit = lane_c * bits
        lo = words(word0 + (bit >> 4))
        hi = words(word0 + (bit >> 4) + 1) if km.codes_straddle_words(bits) else None
        return km.unpack_codes(lo, hi, lane_c, bits)

    if p.key_format == "raw":
        k = km.half_bits_to_f32(words(f.key + lane_c), p.raw_dtype)
        v = km.half_bits_to_f32(words(f.value + lane_c), p.raw_dtype)
    else:
        if p.key_format == "fp8":
            w = words(f.key + (lane_c >> 1))
            byte = lax.shift_right_logical(w, (lane_c & 1) * 8) & 0xFF
            k = km.fp8_e4m3fn_decode(byte)
        else:
            c = cb_ref[codes(f.key, p.key_bits)]
            norm = km.half_bits_to_f32(token_field(f.key_norm))
            if p.norm_correction:
                sq = jnp.sum(jnp.where(keep, c * c, 0.0), axis=1)
                factor = km.ieee_div(norm, jnp.sqrt(jnp.where(sq > 0.0, sq, 1.0)), use_ptx=spec.ptx_div)
            else:
                factor = norm
            k = c * factor[:, None]
        scale = km.half_bits_to_f32(token_field(f.value_scale))
        zero = km.half_bits_to_f32(token_field(f.value_zero))
        vc = codes(f.value, p.value_bits).astype(jnp.float32)
        v = vc * scale[:, None] + zero[:, None]
    return jnp.where(keep, k, 0.0), jnp.where(keep, v, 0.0)


def online_softmax_step(s, valid, v, m, l, acc, compute_dtype):
    """One key tile of the streaming softmax (float32 state).

    Args:
      s: float32 ``[rows, block_n]`` scaled (and soft-capped) logits.
      valid: bool, same shape: the (row, key) pairs that are visible.
      v: ``[block_n, Dp]`` values (already zero where no row may look).
      m, l: float32 ``[rows]`` running max and denominator; acc float32 ``[rows, Dp]``.
    """
    s = jnp.where(valid, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    # A row that has seen no visible key keeps m = -inf; shift by 0 instead so
    # that exp() sees -inf - 0 = -inf (-> 0), never -inf - -inf (NaN).
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    prob = jnp.exp(s - m_safe[:, None])
    l = l * alpha + jnp.sum(prob, axis=1)
    pv = lax.dot_general(
        prob.astype(compute_dtype), v.astype(compute_dtype), (((1,), (0,)), ((), ())),
        precision=_precision(compute_dtype), preferred_element_type=jnp.float32,
    )
    return m_new, l, acc * alpha[:, None] + pv


def scores(q, k, *, scale: float, soft_cap: float | None, compute_dtype):
    """``scale * q @ k^T`` in float32 (then ``cap * tanh(s / cap)``); q ``[rows, Dp]``, k ``[bn, Dp]``."""
    s = lax.dot_general(
        q.astype(compute_dtype), k.astype(compute_dtype), (((1,), (1,)), ((), ())),
        precision=_precision(compute_dtype), preferred_element_type=jnp.float32,
    )
    s = s * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    return s


def _precision(compute_dtype):
    # float32 operands must not silently become TF32 on the GPU: HIGHEST makes
    # the Triton lowering emit an IEEE fp32 dot.
    return lax.Precision.HIGHEST if jnp.dtype(compute_dtype) == jnp.float32 else None
