"""The ``decode`` path: split-KV attention with a log-sum-exp merge.

Grid ``(B, Hkv, num_splits)``. Program ``(b, g, s)`` owns key positions
``[s * chunk, (s + 1) * chunk)`` of sequence ``b`` (``chunk`` = the sequence's
length split ``num_splits`` ways, rounded up to whole tiles) and serves every
query head of kv group ``g`` at once: the group is padded to at least 16 rows,
so each K/V element is dequantized once per program and both products are
tensor-core shaped dots with float32 accumulation. The program loops over the
sequence's query tokens (``q_len`` is 1 for decode, but any value is correct)
and writes float32 partials ``(acc, m, l)`` for each; a split with no visible
key writes ``(0, -inf, 0)`` and merges as nothing. Buffers have fixed shapes
(``num_splits`` is static), so the path has no data-dependent allocation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import kernel_math as km
from .kv_tiles import TileSpec, load_kv_tile, online_softmax_step, scores
from .platform import pallas_kwargs


@dataclass(frozen=True)
class DecodeConfig:
    tiles: TileSpec
    num_q_heads: int
    group: int  # query heads per kv head
    group_rows: int  # group padded to a power of two >= 16
    num_splits: int
    scale: float
    window: int | None
    soft_cap: float | None
    compute_dtype: str
    num_warps: int


def decode_partials(cfg: DecodeConfig, q, cache, block_table, seq_lens, query_start_loc, centroids, *,
                    interpret, poison: bool = False):
    """Runs the kernel; returns ``acc [T, Hkv, S, R, Dp]``, ``m, l [T, Hkv, S, R]`` (float32).

    ``poison=True`` (tests) aliases NaN-filled buffers as the outputs, so an
    element the kernel fails to write shows up as NaN on every backend.
    """
    t = q.shape[0]
    b = block_table.shape[0]
    hkv = cache.shape[2]
    ns, rows, dp = cfg.num_splits, cfg.group_rows, cfg.tiles.head_dim_padded
    operands = [q, cache, block_table, seq_lens, query_start_loc]
    if centroids is not None:
        operands.append(centroids)
    out_shape = (
        jax.ShapeDtypeStruct((t, hkv, ns, rows, dp), jnp.float32),
        jax.ShapeDtypeStruct((t, hkv, ns, rows), jnp.float32),
        jax.ShapeDtypeStruct((t, hkv, ns, rows), jnp.float32),
    )
    aliases = {}
    if poison:
        aliases = {len(operands) + i: i for i in range(3)}
        operands += [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape]
    return pl.pallas_call(
        functools.partial(_decode_kernel, cfg=cfg, has_codebook=centroids is not None, poison=poison),
        out_shape=out_shape,
        input_output_aliases=aliases,
        grid=(b, hkv, ns),
        name="tq_paged_attention_decode",
        **pallas_kwargs(interpret=interpret, num_warps=cfg.num_warps),
    )(*operands)


def merge_partials(acc, m, l, *, group: int, head_dim: int, sinks, out_dtype):
    """Log-sum-exp merge of the split partials -> ``[T, Hq, D]`` in `out_dtype`.

    Sinks (float32 ``[Hq]`` or None) join the denominator only. Rows with no
    visible key anywhere are zeros (``l == 0`` in every split); a NaN ``l``
    (NaN query, key or value) counts as seen, so the NaN reaches the output.
    """
    t, hkv, ns, _, _ = acc.shape
    acc = acc[:, :, :, :group, :head_dim]
    m = m[:, :, :, :group]
    l = l[:, :, :, :group]
    m_max = jnp.max(m, axis=2)  # [T, Hkv, G]
    seen = jnp.sum(l, axis=2) != 0.0  # not `> 0`: NaN must count as seen
    m_ref = jnp.where(seen, m_max, 0.0)
    if sinks is not None:
        m_ref = jnp.maximum(m_ref, sinks.astype(jnp.float32).reshape(hkv, group)[None])
    w = jnp.exp(m - m_ref[:, :, None, :])  # empty splits: exp(-inf) = 0
    denom = jnp.sum(w * l, axis=2)
    num = jnp.sum(w[..., None] * acc, axis=2)
    if sinks is not None:
        denom = denom + jnp.exp(sinks.astype(jnp.float32).reshape(hkv, group)[None] - m_ref)
    out = num / jnp.where(seen, denom, 1.0)[..., None]
    out = jnp.where(seen[..., None], out, 0.0)
    return out.reshape(t, hkv * group, head_dim).astype(out_dtype)


def _decode_kernel(*refs, cfg: DecodeConfig, has_codebook: bool, poison: bool):
    if poison:  # drop the aliased input copies of the outputs
        refs = refs[:-6] + refs[-3:]
    if has_codebook:
        q_ref, cache_ref, bt_ref, sl_ref, qsl_ref, cb_ref, o_ref, m_ref, l_ref = refs
    else:
        q_ref, cache_ref, bt_ref, sl_ref, qsl_ref, o_ref, m_ref, l_ref = refs
        cb_ref = None
    spec = cfg.tiles
    bn, dp, d = spec.block_n, spec.head_dim_padded, spec.head_dim
    b = pl.program_id(0)
    g = pl.program_id(1)
    split = pl.program_id(2)
    seq_len = sl_ref[b]
    q_start = qsl_ref[b]
    q_len = qsl_ref[b + 1] - q_start
    chunk = km.cdiv(km.cdiv(seq_len, cfg.num_splits), bn) * bn
    split_lo = split * chunk
    split_hi = jnp.minimum(split_lo + chunk, seq_len)

    rows = lax.broadcasted_iota(jnp.int32, (cfg.group_rows,), 0)
    row_ok = rows < cfg.group
    heads = g * cfg.group + jnp.minimum(rows, cfg.group - 1)
    lane = lax.broadcasted_iota(jnp.int32, (1, dp), 1)
    q_mask = row_ok[:, None] & (lane < d)
    lane_c = jnp.minimum(lane, d - 1)

    def one_query(i, carry):
        t = q_start + i
        pos = seq_len - q_len + i
        q = q_ref[t, heads[:, None], lane_c].astype(jnp.float32)
        q = jnp.where(q_mask, q, 0.0).astype(cfg.compute_dtype)
        lo = split_lo if cfg.window is None else jnp.maximum(split_lo, pos - cfg.window + 1)
        hi = jnp.minimum(split_hi, pos + 1)

        def one_tile(k_idx, state):
            m, l, acc = state
            start = k_idx * bn
            j = start + lax.broadcasted_iota(jnp.int32, (bn,), 0)
            key_ok = (j >= lo) & (j < hi)
            k, v = load_kv_tile(spec, cache_ref, bt_ref, cb_ref, b, g, start, seq_len, key_ok)
            s = scores(q, k, scale=cfg.scale, soft_cap=cfg.soft_cap, compute_dtype=cfg.compute_dtype)
            valid = row_ok[:, None] & key_ok[None, :]
            return online_softmax_step(s, valid, v, m, l, acc, cfg.compute_dtype)

        init = (
            jnp.full((cfg.group_rows,), -jnp.inf, jnp.float32),
            jnp.zeros((cfg.group_rows,), jnp.float32),
            jnp.zeros((cfg.group_rows, dp), jnp.float32),
        )
        first = lo // bn
        last = jnp.maximum(km.cdiv(hi, bn), first)
        m, l, acc = lax.fori_loop(first, last, one_tile, init)
        o_ref[t, g, split, :, :] = acc
        m_ref[t, g, split, :] = m
        l_ref[t, g, split, :] = l
        return carry

    lax.fori_loop(0, q_len, one_query, 0)
