"""The float64 oracle of every op (DESIGN.md sections 2 and 3).

Same names and argument order as `tq_torch` and `tq_jax`. Everything here is
numpy; inputs may be any float dtype numpy can widen (including ml_dtypes'
bfloat16). `emulate_paged_attention` runs the same math with a kernel's
rounding (operands in the compute dtype, fp32 accumulation) so tolerances can
be sized from "the error of the same math in the leg's precision".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .codebook import Codebook
from .floats import round_to_bf16, round_to_fp16
from .params import QuantParams, quant_params
from .presets import PresetLike
from .quantize import decode_slots, encode_slots, rotate_queries, unrotate_keys
from .validation import check_paged_attention_values, check_store_kv_values

# Query rows handled at once per sequence; bounds the [rows, heads, keys] score block.
_QUERY_CHUNK = 128


# ----------------------------------------------------------------------------- store


def quantize_kv(key, value, *, preset: PresetLike, rotation=None, codebook: Codebook | None = None):
    """Encodes ``key[..., D]`` and ``value[..., D]`` into slots ``uint8[..., slot_bytes]``."""
    d = np.shape(key)[-1]
    return encode_slots(key, value, quant_params(preset, d, rotation=rotation, codebook=codebook))


def dequantize_kv(slots, *, preset: PresetLike, head_dim: int, rotation=None, codebook: Codebook | None = None):
    """Decodes slots ``uint8[..., slot_bytes]`` into ``(K, V)`` float64 ``[..., D]`` (model space)."""
    params = quant_params(preset, head_dim, rotation=rotation, codebook=codebook)
    k, v = decode_slots(slots, params)
    return unrotate_keys(k, params), v


def store_kv(key, value, kv_cache, slot_mapping, *, preset: PresetLike, rotation=None,
             codebook: Codebook | None = None) -> np.ndarray:
    """Quantizes ``key, value [T, Hkv, D]`` and scatters them into a copy of the cache.

    Token ``t`` goes to slot ``s = slot_mapping[t]`` (block ``s // P``, offset
    ``s % P``); ``-1`` skips the token. Returns the new ``uint8[N, P, Hkv, S]``
    cache; every byte outside the named slots is unchanged.
    """
    lay = check_store_kv_values(key, value, kv_cache, slot_mapping, preset=preset)
    params = quant_params(preset, lay.head_dim, rotation=rotation, codebook=codebook)
    cache = np.array(kv_cache, dtype=np.uint8, copy=True)
    sm = np.asarray(slot_mapping).astype(np.int64)
    keep = sm >= 0
    if keep.any():
        slots = encode_slots(np.asarray(key)[keep], np.asarray(value)[keep], params)
        p = cache.shape[1]
        cache[sm[keep] // p, sm[keep] % p] = slots
    return cache


def dequantize_cache(kv_cache, *, preset: PresetLike, head_dim: int, rotation=None,
                     codebook: Codebook | None = None):
    """Decodes a whole cache into ``(K, V)`` float64 ``[N, P, Hkv, D]`` (model space)."""
    return dequantize_kv(kv_cache, preset=preset, head_dim=head_dim, rotation=rotation, codebook=codebook)


# ------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class _Precision:
    """How a leg rounds: operands of the two dots, and the accumulation dtype."""

    round_operand: Callable[[np.ndarray], np.ndarray]
    accumulate: type

    def dot_dtype(self):
        return self.accumulate


_FLOAT64 = _Precision(lambda x: x, np.float64)


def _round_tf32(x: np.ndarray) -> np.ndarray:
    f = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    u = f.view(np.uint32).astype(np.uint64)
    r = ((u + 0xFFF + ((u >> 13) & 1)) >> 13) << 13
    return np.where(np.isfinite(f), r.astype(np.uint32).view(np.float32), f)


_ROUNDERS = {
    "float32": lambda x: np.asarray(x, dtype=np.float32),
    "tfloat32": _round_tf32,
    "bfloat16": round_to_bf16,
    "float16": round_to_fp16,
}
COMPUTE_DTYPES = tuple(_ROUNDERS)


def _gather_tokens(cache: np.ndarray, table_row: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Slots of tokens ``[start, stop)`` of one sequence: ``uint8[n, Hkv, S]``."""
    p = cache.shape[1]
    j = np.arange(start, stop)
    return cache[table_row[j // p].astype(np.int64), j % p]


def _heads_matmul(p, values):
    """``p [r, h, g, n] @ values [n, h, d]`` per kv head -> ``[r, h, g, d]`` (batched BLAS matmuls).

    Also the scores: ``q [r, h, g, d] @ keys.transpose(2, 1, 0) [d, h, n]``."""
    r, h, g, n = p.shape
    ph = np.ascontiguousarray(p.transpose(1, 0, 2, 3).reshape(h, r * g, n))
    return np.matmul(ph, values.transpose(1, 0, 2)).reshape(h, r, g, -1).transpose(1, 0, 2, 3)


def _hidden_safe_nonfinite(p, values, visible):
    """What the NaN/Inf entries of ``values [n, h, d]`` add to ``p @ values``, over visible keys only.

    A plain matmul would give every row ``0 * NaN`` from a key it cannot see (a later
    token, an out-of-window one) although ``p`` is 0 there; DESIGN.md says masked keys
    never leak. Per row and lane, IEEE products over the visible keys give NaN where a
    value is NaN or an Inf meets ``p = 0``, else +Inf / -Inf (both: NaN) where an Inf has
    ``p > 0``. Counted with 0/1 matmuls (exact), returned as 0 / +-Inf / NaN ``[r, h, g, d]``.
    """
    def hits(rows, cols):
        return _heads_matmul(rows.astype(np.float64), cols.astype(np.float64)) > 0

    p_zero, p_pos = visible & (p == 0), visible & (p != 0)
    nan_hits = hits(visible, np.isnan(values)) | hits(p_zero, np.isinf(values))
    extra = np.where(hits(p_pos, values == np.inf), np.inf, 0.0)
    extra = extra + np.where(hits(p_pos, values == -np.inf), -np.inf, 0.0)
    return extra + np.where(nan_hits, np.nan, 0.0)


def _attend_chunk(q, keys, values, q_pos, k_pos, *, scale, window, cap, sinks, prec: _Precision):
    """Attention of query rows ``q [r, Hkv, G, D]`` over ``keys/values [n, Hkv, D]``.

    ``q_pos [r]`` and ``k_pos [n]`` are absolute token positions. Returns
    ``[r, Hkv, G, D]`` in the accumulation dtype.
    """
    acc = prec.accumulate
    # Batched matmuls over kv heads (BLAS) rather than einsum (`_heads_matmul`).
    s = _heads_matmul(q.astype(acc), keys.astype(acc).transpose(2, 1, 0)) * acc(scale)
    if cap is not None:
        s = acc(cap) * np.tanh(s / acc(cap))
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > (q_pos[:, None] - window)
    visible = visible[:, None, None, :]
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, sinks[None, :, :, None].astype(acc))
    any_visible = visible.any(axis=-1, keepdims=True)
    m_safe = np.where(any_visible, m, 0.0).astype(acc)
    p = np.where(visible, np.exp(s - m_safe), 0.0).astype(acc)
    denom = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + np.exp(sinks[None, :, :, None].astype(acc) - m_safe)
    p = prec.round_operand(p).astype(acc)
    values = values.astype(acc)
    finite = np.isfinite(values)
    out = _heads_matmul(p, np.where(finite, values, 0.0))
    if not finite.all():
        out = out + _hidden_safe_nonfinite(p, values, np.broadcast_to(visible, p.shape))
    out = out / np.where(any_visible, denom, 1.0)
    return np.where(any_visible, out, 0.0).astype(acc)


def _paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, *, preset, scale,
                     sliding_window, logits_soft_cap, sinks, rotation, codebook, prec: _Precision,
                     stats: dict | None = None):
    lay = check_paged_attention_values(
        query, kv_cache, block_table, seq_lens, query_start_loc, preset=preset, scale=scale,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
    )
    d = lay.head_dim
    params: QuantParams = quant_params(preset, d, rotation=rotation, codebook=codebook)
    cache = np.asarray(kv_cache)
    bt = np.asarray(block_table).astype(np.int64)
    sl = np.asarray(seq_lens).astype(np.int64)
    qsl = np.asarray(query_start_loc).astype(np.int64)
    t, hq, _ = np.shape(query)
    hkv = cache.shape[2]
    g = hq // hkv
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    if stats is not None:
        stats.update(head_dim=d, scale=scale, max_key_norm=0.0, max_abs_value=0.0)
    sink = None if sinks is None else np.asarray(sinks, dtype=np.float64).reshape(hkv, g)

    q = np.asarray(query).astype(np.float64)
    # Kernels see the query in its own dtype, rotate it in fp32, then feed the
    # dot in the compute dtype; the reference rotates in float64.
    if prec is _FLOAT64:
        q = rotate_queries(q, params)
    elif params.rotation is not None:
        q = np.matmul(q.astype(np.float32), params.rotation.T)  # fp32 accumulation, as kernels
    if stats is not None:
        stats["max_query_norm"] = float(np.sqrt((q.astype(np.float64) ** 2).sum(-1)).max(initial=0.0))
    q = prec.round_operand(q).reshape(t, hkv, g, d)
    out = np.zeros((t, hkv, g, d), dtype=prec.accumulate)
    for b in range(bt.shape[0]):
        start, stop = int(qsl[b]), int(qsl[b + 1])
        if start == stop:
            continue
        length = int(sl[b])
        first = length - (stop - start)
        # Only keys some row may see are read: masked pages never reach the math.
        seq_lo = 0 if sliding_window is None else max(0, first - sliding_window + 1)
        k_seq, v_seq = decode_slots(_gather_tokens(cache, bt[b], seq_lo, length), params,
                                    dtype=prec.accumulate)
        k_seq, v_seq = prec.round_operand(k_seq), prec.round_operand(v_seq)
        if stats is not None and len(k_seq):
            kn = float(np.sqrt((k_seq.astype(np.float64) ** 2).sum(-1)).max())
            stats["max_key_norm"] = max(stats.get("max_key_norm", 0.0), kn)
            stats["max_abs_value"] = max(stats.get("max_abs_value", 0.0), float(np.abs(v_seq).max()))
        for c0 in range(start, stop, _QUERY_CHUNK):
            c1 = min(stop, c0 + _QUERY_CHUNK)
            q_pos = first + np.arange(c0 - start, c1 - start)
            k_lo = 0 if sliding_window is None else max(0, int(q_pos[0]) - sliding_window + 1)
            k_hi = int(q_pos[-1]) + 1
            out[c0:c1] = _attend_chunk(
                q[c0:c1], k_seq[k_lo - seq_lo:k_hi - seq_lo], v_seq[k_lo - seq_lo:k_hi - seq_lo],
                q_pos, np.arange(k_lo, k_hi), scale=scale, window=sliding_window,
                cap=logits_soft_cap, sinks=sink, prec=prec,
            )
    return out.reshape(t, hq, d)


def paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, *, preset: PresetLike,
                    scale=None, sliding_window=None, logits_soft_cap=None, sinks=None, rotation=None,
                    codebook: Codebook | None = None) -> np.ndarray:
    """Float64 paged attention over a quantized cache (DESIGN.md section 3).

    Args:
      query: ``[T, Hq, D]`` float; sequence ``b`` owns rows
        ``[query_start_loc[b], query_start_loc[b+1])``, its last tokens.
      kv_cache: ``uint8[N, P, Hkv, slot_bytes]``; every key and value is read from it.
      block_table: ``int32[B, max_blocks]``; seq_lens ``int32[B]``;
        query_start_loc ``int32[B + 1]``.
      scale: logit scale, default ``1/sqrt(D)``.
      sliding_window: None or ``W >= 1``: key ``j`` visible to position ``i``
        iff ``i - W < j <= i``.
      logits_soft_cap: None or ``cap > 0``: ``s = cap * tanh(s / cap)`` before masking.
      sinks: None or float32 ``[Hq]`` logits added to the softmax denominator only.
      rotation, codebook: see `tq_spec.quant_params`.

    Returns:
      float64 ``[T, Hq, D]``; rows without a visible key are zeros.
    """
    return _paged_attention(
        query, kv_cache, block_table, seq_lens, query_start_loc, preset=preset, scale=scale,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
        rotation=rotation, codebook=codebook, prec=_FLOAT64,
    )


def emulate_paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, *,
                            preset: PresetLike, compute_dtype: str, out_dtype: str | None = None,
                            scale=None, sliding_window=None, logits_soft_cap=None, sinks=None,
                            rotation=None, codebook: Codebook | None = None,
                            stats: dict | None = None) -> np.ndarray:
    """`paged_attention` computed the way a kernel does, to size tolerances.

    Operands of both dots (rotated query, decoded K, decoded V, softmax
    probabilities) are rounded to `compute_dtype` (one of `COMPUTE_DTYPES`),
    everything accumulates in float32, and the result is rounded to
    `out_dtype` (default: `compute_dtype`, or float32 for tfloat32). The
    query rotation and the key/value decode run in float32, as in the kernels.
    Returns float64 ``[T, Hq, D]`` holding the rounded values. If `stats` is a
    dict it receives ``head_dim``, ``scale``, ``max_query_norm`` (rotated),
    ``max_key_norm`` and ``max_abs_value`` over the keys actually read.
    """
    if compute_dtype not in _ROUNDERS:
        raise ValueError(f"compute_dtype: expected one of {COMPUTE_DTYPES}, got {compute_dtype!r}")
    out_dtype = out_dtype or ("float32" if compute_dtype == "tfloat32" else compute_dtype)
    if out_dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"out_dtype: expected float32, bfloat16 or float16, got {out_dtype!r}")
    prec = _Precision(_ROUNDERS[compute_dtype], np.float32)
    out = _paged_attention(
        query, kv_cache, block_table, seq_lens, query_start_loc, preset=preset, scale=scale,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
        rotation=rotation, codebook=codebook, prec=prec, stats=stats,
    )
    return _ROUNDERS[out_dtype](out).astype(np.float64)
