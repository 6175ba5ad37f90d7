"""Path ``decode``: split-KV attention with a log-sum-exp merge.

Kernel (`attention_kernel` with ``split_kv``): one program per (query tile, kv
head, split). Decode tiles are short: ``block_m`` is the GQA group padded to a
power of two >= 16 (tensor-core dots), and the spare rows take the sequence's
next query tokens, so a decode step (q_len 1) is one tile per (sequence, kv
head) and a multi-token step (q_len 2-8 at GQA 4) still one. Longer q_len
simply gives a sequence more tiles, so the path is correct for any q_len.
Each tile's key range (causal end, window start) is cut into ``num_splits``
equal, ``block_n``-aligned chunks; chunks past the end are empty and write
``m = -inf, l = 0, acc = 0``. Partials exist for real rows only.

The merge runs in XLA (no atomics): per (token, query head) it adds sinks to
the denominator and zeros rows that saw no key. Buffers have static shapes
``[T, Hq, num_splits, ...]`` and ``num_splits`` depends only on static shapes.
"""

from __future__ import annotations

import jax.numpy as jnp

from .attention_kernel import AttentionConfig, launch_tiles


def decode_partials(cfg: AttentionConfig, q, cache, block_table, seq_lens, query_start_loc, key_tables, *,
                    interpret, poison: bool = False):
    """Runs the kernel; returns ``acc [T, Hq, S, D]``, ``m, l [T, Hq, S]`` (float32).

    Entries of padding rows (outside ``[qsl[0], qsl[B])``) are unspecified.
    """
    return launch_tiles(cfg, q, cache, block_table, seq_lens, query_start_loc, key_tables, None,
                        out_dtype=jnp.float32, interpret=interpret, poison=poison)


def merge_partials(acc, m, l, *, sinks, out_dtype):
    """Log-sum-exp merge of the split partials -> ``[T, Hq, D]`` in `out_dtype`.

    Sinks (float32 ``[Hq]`` or None) join the denominator only. Rows with no
    visible key anywhere are zeros (``l == 0`` in every split); a NaN ``l``
    (NaN query, key or value) counts as seen, so the NaN reaches the output.
    """
    m_max = jnp.max(m, axis=2)  # [T, Hq]
    seen = _sum_splits(l) != 0.0  # not `> 0`: NaN must count as seen
    m_ref = jnp.where(seen, m_max, 0.0)
    if sinks is not None:
        m_ref = jnp.maximum(m_ref, sinks.astype(jnp.float32)[None])
    w = jnp.exp(m - m_ref[:, :, None])  # empty splits: exp(-inf) = 0
    denom = _sum_splits(w * l)
    num = _sum_splits(w[..., None] * acc)
    if sinks is not None:
        denom = denom + jnp.exp(sinks.astype(jnp.float32)[None] - m_ref)
    out = num / jnp.where(seen, denom, 1.0)[..., None]
    out = jnp.where(seen[..., None], out, 0.0)
    return out.astype(out_dtype)


def _sum_splits(x):
    """``x.sum(axis=2)`` added split by split, in order (one XLA fusion).

    A `jnp.sum` reduction's order is XLA's choice and depends on the whole
    shape; a fixed order makes a row's result independent of how many tokens
    and heads share the call, so `tq_jax.sharding` (half the heads per device)
    is bit for bit the single-device op on GPUs too.
    """
    total = x[:, :, 0]
    for s in range(1, x.shape[2]):
        total = total + x[:, :, s]
    return total
