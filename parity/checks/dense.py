"""Float64 attention on raw (unquantized, unpaged) keys and values.

The end-to-end check compares a leg's store-then-attend output with this: it
measures what quantization costs, not whether a kernel matches the format.
Written independently of `tq_spec.reference` (which reads a cache) from the
semantics of DESIGN.md section 3.
"""

from __future__ import annotations

import numpy as np

_ROWS = 128  # query rows per block: bounds the [Hkv, G * rows, keys] score matrix


def dense_attention(seq_queries, seq_keys, seq_values, *, scale=None, sliding_window=None,
                    logits_soft_cap=None, sinks=None) -> np.ndarray:
    """Causal (optionally windowed, soft-capped, sink-augmented) attention.

    Args:
      seq_queries: per sequence ``[q_len, Hq, D]`` (the last q_len positions).
      seq_keys, seq_values: per sequence ``[seq_len, Hkv, D]`` (positions 0..seq_len-1).
      scale: logit scale, default ``1/sqrt(D)``.
      sinks: None or ``[Hq]`` logits added to the denominator only.

    Returns:
      float64 ``[sum(q_len), Hq, D]``; rows without a visible key are zeros.
    """
    outs = []
    for q, k, v in zip(seq_queries, seq_keys, seq_values):
        q = np.asarray(q, dtype=np.float64)
        q_len, hq, d = q.shape
        k = np.asarray(k, dtype=np.float64)
        v = np.asarray(v, dtype=np.float64)
        s_len, hkv, _ = k.shape
        sc = 1.0 / np.sqrt(d) if scale is None else float(scale)
        g = hq // hkv
        sink = None if sinks is None else np.asarray(sinks, np.float64).reshape(hkv, g)
        kt = k.transpose(1, 2, 0)  # [Hkv, D, L]
        vt = v.transpose(1, 0, 2)  # [Hkv, L, D]
        out = np.zeros((q_len, hkv, g, d))
        for r0 in range(0, q_len, _ROWS):
            r1 = min(q_len, r0 + _ROWS)
            pos = s_len - q_len + np.arange(r0, r1)
            lo = 0 if sliding_window is None else max(0, int(pos[0]) - sliding_window + 1)
            hi = int(pos[-1]) + 1
            key_pos = np.arange(lo, hi)
            # Query head h = kv * g + j reads kv head kv (GQA).
            qb = q[r0:r1].reshape(r1 - r0, hkv, g, d).transpose(1, 2, 0, 3)  # [Hkv, G, r, D]
            logits = np.matmul(qb, kt[None, :, :, lo:hi].transpose(1, 0, 2, 3)) * sc  # [Hkv, G, r, n]
            if logits_soft_cap is not None:
                logits = logits_soft_cap * np.tanh(logits / logits_soft_cap)
            visible = key_pos[None, :] <= pos[:, None]
            if sliding_window is not None:
                visible &= key_pos[None, :] > pos[:, None] - sliding_window
            logits = np.where(visible, logits, -np.inf)
            row_max = logits.max(axis=-1, keepdims=True) if hi > lo else np.full(logits.shape[:-1] + (1,), -np.inf)
            if sink is not None:
                row_max = np.maximum(row_max, sink[:, :, None, None])
            row_max = np.where(np.isfinite(row_max), row_max, 0.0)
            w = np.where(visible, np.exp(logits - row_max), 0.0)
            denom = w.sum(axis=-1, keepdims=True)
            if sink is not None:
                denom = denom + np.exp(sink[:, :, None, None] - row_max)
            o = np.matmul(w / np.where(denom > 0, denom, 1.0), vt[:, None, lo:hi])  # [Hkv, G, r, D]
            has_key = visible.any(axis=-1)  # [r]
            out[r0:r1] = np.where(has_key[:, None, None, None], o.transpose(2, 0, 1, 3), 0.0)
        outs.append(out.reshape(q_len, hq, d))
    if not outs:
        return np.zeros((0, 0, 0))
    return np.concatenate(outs, axis=0)
