"""The ``extend`` path: query-row tiles x key tiles with causal and window masks.

Grid ``(T // BQ + B, Hkv)``. Program ``(p, g)`` finds its sequence ``b`` as the
last one whose first tile index ``qsl[b] // BQ + b`` is ``<= p`` (an upper
bound on the tiles of earlier sequences, so every tile of every sequence gets
a program, and surplus programs exit at once). A tile holds ``BQ`` query
tokens x the kv group's query heads (padded to a power of two) as rows, so
each K/V element is dequantized once per (tile, kv head). Key tiles run from
the first position any row may see (window) to the last row's position
(causal); visibility is then masked per (row, key).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import kernel_math as km
from .kv_tiles import TileSpec, load_kv_tile, online_softmax_step, scores
from .platform import pallas_kwargs


@dataclass(frozen=True)
class ExtendConfig:
    tiles: TileSpec
    num_q_heads: int
    group: int
    group_pow2: int  # query heads per kv head, padded to a power of two
    block_q: int  # query tokens per tile; rows = block_q * group_pow2 (>= 16)
    scale: float
    window: int | None
    soft_cap: float | None
    compute_dtype: str
    num_warps: int

    @property
    def rows(self) -> int:
        return self.block_q * self.group_pow2


def extend_attention(cfg: ExtendConfig, q, cache, block_table, seq_lens, query_start_loc, centroids, sinks,
                     *, out_dtype, interpret, poison: bool = False):
    """Runs the kernel; returns ``[T, Hq, D]`` in `out_dtype`.

    ``poison=True`` (tests) aliases a NaN-filled buffer as the output.
    """
    t, hq, d = q.shape
    b = block_table.shape[0]
    hkv = cache.shape[2]
    operands = [q, cache, block_table, seq_lens, query_start_loc]
    if centroids is not None:
        operands.append(centroids)
    if sinks is not None:
        operands.append(sinks.astype(jnp.float32))
    aliases = {}
    if poison:
        aliases = {len(operands): 0}
        operands.append(jnp.full((t, hq, d), jnp.nan, out_dtype))
    return pl.pallas_call(
        functools.partial(_extend_kernel, cfg=cfg, num_seqs=b, has_codebook=centroids is not None,
                          has_sinks=sinks is not None, poison=poison),
        out_shape=jax.ShapeDtypeStruct((t, hq, d), out_dtype),
        input_output_aliases=aliases,
        grid=(t // cfg.block_q + b, hkv),
        name="tq_paged_attention_extend",
        **pallas_kwargs(interpret=interpret, num_warps=cfg.num_warps),
    )(*operands)


def _extend_kernel(*refs, cfg: ExtendConfig, num_seqs: int, has_codebook: bool, has_sinks: bool,
                   poison: bool):
    refs = list(refs)
    if poison:  # drop the aliased input copy of the output
        del refs[-2]
    q_ref, cache_ref, bt_ref, sl_ref, qsl_ref = refs[:5]
    rest = refs[5:]
    cb_ref = rest.pop(0) if has_codebook else None
    sinks_ref = rest.pop(0) if has_sinks else None
    (o_ref,) = rest
    spec = cfg.tiles
    bn, dp, d = spec.block_n, spec.head_dim_padded, spec.head_dim
    bq, gp = cfg.block_q, cfg.group_pow2
    p = pl.program_id(0)
    g = pl.program_id(1)

    # Which sequence owns tile p: count the sequences whose first tile is <= p.
    seq = lax.broadcasted_iota(jnp.int32, (km.next_pow2(max(num_seqs, 2)),), 0)
    seq_c = jnp.minimum(seq, num_seqs - 1)
    first_tile = qsl_ref[seq_c] // bq + seq_c
    b = jnp.sum(jnp.where((seq < num_seqs) & (first_tile <= p), 1, 0)) - 1
    q_start = qsl_ref[b]
    q_len = qsl_ref[b + 1] - q_start
    q0 = (p - (q_start // bq + b)) * bq

    @pl.when(q0 < q_len)
    def _tile():
        seq_len = sl_ref[b]
        r = lax.broadcasted_iota(jnp.int32, (cfg.rows,), 0)
        tok = q0 + r // gp
        hd = r % gp
        row_ok = (tok < q_len) & (hd < cfg.group)
        lane = lax.broadcasted_iota(jnp.int32, (1, dp), 1)
        lane_c = jnp.minimum(lane, d - 1)
        t_c = q_start + jnp.minimum(tok, q_len - 1)
        h_c = g * cfg.group + jnp.minimum(hd, cfg.group - 1)
        q = q_ref[t_c[:, None], h_c[:, None], lane_c].astype(jnp.float32)
        q = jnp.where(row_ok[:, None] & (lane < d), q, 0.0).astype(cfg.compute_dtype)
        pos = seq_len - q_len + tok  # [rows]
        first_pos = seq_len - q_len + q0
        last_pos = seq_len - q_len + jnp.minimum(q0 + bq, q_len) - 1
        lo = 0 if cfg.window is None else jnp.maximum(first_pos - cfg.window + 1, 0)
        hi = last_pos + 1

        def one_tile(k_idx, state):
            m, l, acc = state
            start = k_idx * bn
            j = start + lax.broadcasted_iota(jnp.int32, (bn,), 0)
            key_ok = (j >= lo) & (j < hi)
            k, v = load_kv_tile(spec, cache_ref, bt_ref, cb_ref, b, g, start, seq_len, key_ok)
            s = scores(q, k, scale=cfg.scale, soft_cap=cfg.soft_cap, compute_dtype=cfg.compute_dtype)
            valid = row_ok[:, None] & key_ok[None, :] & (j[None, :] <= pos[:, None])
            if cfg.window is not None:
                valid = valid & (j[None, :] > pos[:, None] - cfg.window)
            return online_softmax_step(s, valid, v, m, l, acc, cfg.compute_dtype)

        init = (
            jnp.full((cfg.rows,), -jnp.inf, jnp.float32),
            jnp.zeros((cfg.rows,), jnp.float32),
            jnp.zeros((cfg.rows, dp), jnp.float32),
        )
        first = lo // bn
        m, l, acc = lax.fori_loop(first, jnp.maximum(km.cdiv(hi, bn), first), one_tile, init)

        seen = l != 0.0  # NaN counts as seen (propagates); only l == 0 means no visible key
        m_ref = jnp.where(seen, m, 0.0)
        denom = l
        if sinks_ref is not None:
            sink = sinks_ref[h_c]
            m_new = jnp.maximum(m_ref, sink)
            rescale = jnp.exp(m_ref - m_new)
            acc = acc * rescale[:, None]
            denom = l * rescale + jnp.exp(sink - m_new)
        out = km.ieee_div(acc, jnp.where(seen, denom, 1.0)[:, None], use_ptx=spec.ptx_div)
        out = jnp.where(seen[:, None], out, 0.0).astype(o_ref.dtype)
        # Unclamped row/lane indices: every lane of this store has its own
        # address (masked lanes included), as interpret mode requires.
        t_idx = (q_start + tok)[:, None]
        h_idx = (g * cfg.group + hd)[:, None]
        pltriton.store(o_ref.at[t_idx, h_idx, lane], out, mask=row_ok[:, None] & (lane < d))
