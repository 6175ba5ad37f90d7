"""The one attention kernel both paths launch: a tile of query rows x all (or one
split of) its visible keys (tq_torch's ``attention_kernel``, in Pallas).

Grid ``(T // block_q + B, Hkv, num_splits)``. Sequence ``b`` owns tile ids
``[qsl[b] // block_q + b, qsl[b+1] // block_q + b + 1)`` (on the extend path in launch
order from the last tile down: `_longest_tiles_first`), enough for
``ceil(q_len / block_q)`` tiles; a program finds its sequence as the last one
whose first tile id is ``<= p`` (`_find_sequence`, which also gives every row at
most one owner when the metadata is bad) and exits if its tile is past the
sequence's queries. The grid depends only on static shapes (no host sync).

A tile packs ``block_q = block_m // G`` query tokens x the ``G`` query heads of
one kv head into its rows (row ``r``: token ``r // G``, head ``r % G``), so
every K/V element is decoded once per tile and serves the whole GQA group (and
the sequence's next tokens: a multi-token decode step costs about one
single-token step). Only keys in ``[window start of the first row, position of
the last row]`` are visited.

``split_kv`` (decode path): the tile's key range is cut into ``num_splits``
equal, ``block_n``-aligned chunks; split ``s`` takes chunk ``s`` and writes
unnormalised partials (``acc``, ``m``, ``l``) of the real rows only, for the
merge in `decode`; chunks past the end are empty and write ``m = -inf, l = 0,
acc = 0``. Otherwise (extend path) the tile normalises, adds sinks and writes
the output rows.
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
from .kv_tiles import TileSpec, attend_key_range, load_query_parts
from .platform import pallas_kwargs


@dataclass(frozen=True)
class AttentionConfig:
    tiles: TileSpec
    num_q_heads: int
    group: int  # query heads per kv head (any ratio)
    block_m: int  # rows per tile, power of two >= 16 and >= group
    split_kv: bool
    num_splits: int  # 1 unless split_kv
    scale: float
    window: int | None
    soft_cap: float | None
    num_warps: int
    num_stages: int
    max_registers: int | None = None  # Triton ``maxnreg`` (`platform.pallas_kwargs`)
    unmasked_tiles: bool = True  # `kv_tiles.attend_key_range`: three key loops, or one checked loop

    @property
    def block_q(self) -> int:
        """Query tokens per tile."""
        return max(1, self.block_m // self.group)


def launch_tiles(cfg: AttentionConfig, q, cache, block_table, seq_lens, query_start_loc, key_tables, sinks, *,
                 out_dtype, interpret, poison: bool = False):
    """Runs the kernel over every (tile, kv head, split).

    ``split_kv``: returns float32 partials ``acc [T, Hq, S, D]``, ``m, l [T, Hq, S]``
    (entries of padding rows are unspecified); else the output ``[T, Hq, D]`` in
    `out_dtype` (padding rows unspecified). ``poison=True`` (tests) aliases
    NaN-filled buffers as the outputs, so an element the kernel fails to write
    shows up as NaN on every backend.
    """
    t, hq, d = q.shape
    b = block_table.shape[0]
    hkv = cache.shape[2]
    operands = [q, cache, block_table, seq_lens, query_start_loc]
    if key_tables is not None:
        operands.append(key_tables)
    has_sinks = sinks is not None and not cfg.split_kv  # the decode merge adds sinks
    if has_sinks:
        operands.append(sinks.astype(jnp.float32))
    if cfg.split_kv:
        ns = cfg.num_splits
        out_shape = (jax.ShapeDtypeStruct((t, hq, ns, d), jnp.float32),
                     jax.ShapeDtypeStruct((t, hq, ns), jnp.float32),
                     jax.ShapeDtypeStruct((t, hq, ns), jnp.float32))
    else:
        out_shape = (jax.ShapeDtypeStruct((t, hq, d), out_dtype),)
    aliases = {}
    if poison:
        aliases = {len(operands) + i: i for i in range(len(out_shape))}
        operands += [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape]
    outs = pl.pallas_call(
        functools.partial(_paged_attention_kernel, cfg=cfg, num_seqs=b, has_tables=key_tables is not None,
                          has_sinks=has_sinks, num_outputs=len(out_shape), poison=poison),
        out_shape=out_shape,
        input_output_aliases=aliases,
        grid=(t // cfg.block_q + b, hkv, cfg.num_splits),
        **pallas_kwargs(interpret=interpret,
                        name="tq_paged_attention_decode" if cfg.split_kv else "tq_paged_attention_extend",
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages, max_registers=cfg.max_registers),
    )(*operands)
    return tuple(outs) if cfg.split_kv else outs[0]


SEQ_CHUNK = 128  # sequences scanned per step by `_find_sequence` (tq_torch's SEQ_CHUNK)


def _find_sequence(qsl_ref, p, num_seqs: int, num_tokens: int, block_q: int):
    """Sequence, first row and row count of tile id ``p``: ``(b, q_start, q_len)``, int32 scalars.

    Query rows are laid out from the metadata so that every row has at most one
    owner whatever ``query_start_loc`` holds: with ``c = clip(qsl, 0, T)``,
    sequence ``b`` starts at ``s[b] = min(T, c[0] + sum_{j<b} max(c[j+1] - c[j], 0))``
    and owns ``[s[b], s[b+1])``. For valid metadata ``s == qsl``. ``s`` never
    decreases, so the first tile ids ``s[b] // block_q + b`` increase and tile
    ``p`` belongs to the last sequence whose first tile id is ``<= p`` (a tile
    before the first sequence's rows gets ``b = 0`` and a negative offset: the
    caller skips it). Sequences are scanned ``SEQ_CHUNK`` at a time (int32
    prefix sums stay exact for T < 2**31 / (SEQ_CHUNK + 2)).
    """
    if num_seqs == 1:  # one sequence (the B = 1 decode latency case): no scan
        q_start = jnp.clip(qsl_ref[0], 0, num_tokens)
        return jnp.int32(0), q_start, jnp.clip(qsl_ref[1], q_start, num_tokens) - q_start
    width = min(km.next_pow2(max(num_seqs, 2)), SEQ_CHUNK)
    j = lax.broadcasted_iota(jnp.int32, (width,), 0)
    first = jnp.clip(qsl_ref[0], 0, num_tokens)

    def chunk(c, carry):
        base, count, q_start = carry
        idx = c * width + j
        live = idx < num_seqs
        idx_c = jnp.minimum(idx, num_seqs - 1)
        lo = jnp.clip(qsl_ref[idx_c], 0, num_tokens)
        hi = jnp.clip(qsl_ref[idx_c + 1], 0, num_tokens)
        grow = jnp.where(live, jnp.maximum(hi - lo, 0), 0)
        s = jnp.minimum(base + jnp.cumsum(grow) - grow, num_tokens)
        take = live & (km.div_nonneg(s, block_q) + idx <= p)
        return (jnp.minimum(base + jnp.sum(grow), num_tokens), count + jnp.sum(take.astype(jnp.int32)),
                jnp.maximum(q_start, jnp.max(jnp.where(take, s, 0))))

    init = (first, jnp.int32(0), first)
    n_chunks = -(-num_seqs // width)
    _, count, q_start = chunk(0, init) if n_chunks == 1 else lax.fori_loop(0, n_chunks, chunk, init)
    b = jnp.maximum(count - 1, 0)
    grow_b = jnp.maximum(jnp.clip(qsl_ref[b + 1], 0, num_tokens) - jnp.clip(qsl_ref[b], 0, num_tokens), 0)
    return b, q_start, jnp.minimum(q_start + grow_b, num_tokens) - q_start


# Kv heads whose tiles the extend path interleaves (`_longest_tiles_first`); tq_torch's TILE_ORDER_HEADS.
TILE_ORDER_HEADS = 4


def _longest_tiles_first(x, y, nx: int, ny: int, heads: int):
    """Extend path: ``(tile id, kv head)`` of program ``(x, y)`` of a static ``(nx, ny)`` grid.

    The GPU starts programs in launch order (``x`` fastest), and a sequence's
    last tiles see the most keys (causal). Launch order takes the kv heads
    ``heads`` at a time (one at a time if ``ny`` is not a multiple), and each
    group's tiles from the last down, its heads next to each other: the final
    wave holds the shortest tiles instead of the longest. Measured in
    tq_torch's `_longest_tiles_first`; here (H100, 4bit_nc, one call, ms, program
    id order -> heads 4 at a time): 8k prefill 2.395 -> 2.352, window 4k 2.055 ->
    2.007, chunked 0.674 -> 0.657, mixed b16 1.189 -> 1.233.
    """
    launch = y * nx + x
    g = heads if ny % heads == 0 else 1
    r = km.rem_nonneg(launch, g * nx)
    return nx - 1 - km.div_nonneg(r, g), km.div_nonneg(launch, g * nx) * g + km.rem_nonneg(r, g)


def _paged_attention_kernel(*refs, cfg: AttentionConfig, num_seqs: int, has_tables: bool, has_sinks: bool,
                            num_outputs: int, poison: bool):
    refs = list(refs)
    if poison:  # drop the aliased input copies of the outputs
        del refs[-2 * num_outputs:-num_outputs]
    q_ref, cache_ref, bt_ref, sl_ref, qsl_ref = refs[:5]
    rest = refs[5:]
    tab_ref = rest.pop(0) if has_tables else None
    sinks_ref = rest.pop(0) if has_sinks else None
    spec = cfg.tiles
    dp, d, g_size, bq = spec.head_dim_padded, spec.head_dim, cfg.group, cfg.block_q
    if cfg.split_kv:
        p, kv_head = pl.program_id(0), pl.program_id(1)
    else:
        # The grid's static extent (`pl.num_programs` is traced), as `paged_attention` sets it.
        p, kv_head = _longest_tiles_first(pl.program_id(0), pl.program_id(1), q_ref.shape[0] // bq + num_seqs,
                                          cache_ref.shape[2], TILE_ORDER_HEADS)
    split = pl.program_id(2)

    # Metadata guards, always on (no value of qsl/seq_lens/block_table moves an
    # access outside the op's buffers): query ranges clamped to [0, T], lengths
    # to what the block table can address, block ids outside [0, N) mask their
    # keys (`kv_tiles.load_block_ids`).
    t_total = q_ref.shape[0]
    b, q_start, q_len = _find_sequence(qsl_ref, p, num_seqs, t_total, bq)
    tok0 = (p - (km.div_nonneg(q_start, bq) + b)) * bq

    @pl.when((tok0 >= 0) & (tok0 < q_len))
    def _tile():
        seq_len = jnp.clip(sl_ref[b], 0, spec.max_blocks * spec.block_size)
        r = lax.broadcasted_iota(jnp.int32, (cfg.block_m,), 0)
        r_tok = km.div_nonneg(r, g_size)
        tok = tok0 + r_tok
        row_valid = (r_tok < bq) & (tok < q_len)
        head = kv_head * g_size + km.rem_nonneg(r, g_size)
        pos = seq_len - q_len + tok
        # Keys any row of this tile may see: [k_first, k_hi).
        k_hi = seq_len - q_len + jnp.minimum(tok0 + bq, q_len)
        k_first = 0 if cfg.window is None else jnp.maximum(seq_len - q_len + tok0 - cfg.window + 1, 0)
        # Tiles start on multiples of block_n (page-aligned tiles: `kv_tiles.load_block_ids`).
        k_lo = k_first if cfg.window is None else km.div_nonneg(k_first, spec.block_n) * spec.block_n
        if cfg.split_kv:
            per_split = km.div_nonneg(jnp.maximum(k_hi - k_lo, 0) + cfg.num_splits - 1, cfg.num_splits)
            chunk = km.div_nonneg(per_split + spec.block_n - 1, spec.block_n) * spec.block_n
            k_lo = k_lo + split * chunk
            k_hi = jnp.minimum(k_hi, k_lo + chunk)
        lane = lax.broadcasted_iota(jnp.int32, (1, dp), 1)
        # Unclamped row/lane indices: every lane has its own address (interpret
        # mode implements masked stores as read-modify-write of every lane).
        t_row = q_start + tok
        t_idx, h_idx = t_row[:, None], head[:, None]
        rmask = row_valid[:, None] & (lane < d)
        q = load_query_parts(spec, q_ref, t_idx, h_idx, row_valid)
        state = (jnp.full((cfg.block_m,), -jnp.inf, jnp.float32), jnp.zeros((cfg.block_m,), jnp.float32),
                 jnp.zeros((cfg.block_m, dp), jnp.float32))
        # Split-KV decode keeps one checked key loop: with the extend kernel's three loops
        # it measured 10-20 % slower on an H100 (docs/bench/steps.md, session 15).
        m, l, acc = attend_key_range(
            spec, q, state, pos, row_valid, k_first, k_lo, k_hi, cache_ref=cache_ref,
            bt_ref=bt_ref, tab_ref=tab_ref, b=b, kv_head=kv_head, scale=cfg.scale, soft_cap=cfg.soft_cap,
            window=cfg.window, unmasked_tiles=cfg.unmasked_tiles)
        if cfg.split_kv:
            acc_ref, m_ref, l_ref = rest
            pltriton.store(acc_ref.at[t_idx, h_idx, split, lane], acc, mask=rmask)
            pltriton.store(m_ref.at[t_row, head, split], m, mask=row_valid)
            pltriton.store(l_ref.at[t_row, head, split], l, mask=row_valid)
            return
        (o_ref,) = rest
        seen = l != 0.0  # NaN counts as seen (propagates); only l == 0 means no visible key
        m_fin = jnp.where(seen, m, 0.0)
        denom = l
        if sinks_ref is not None:
            sink = pltriton.load(sinks_ref.at[head], mask=row_valid, other=0.0)
            m_new = jnp.maximum(m_fin, sink)
            rescale = jnp.exp(m_fin - m_new)
            acc = acc * rescale[:, None]
            denom = l * rescale + jnp.exp(sink - m_new)
        out = km.ieee_div(acc, jnp.where(seen, denom, 1.0)[:, None], use_ptx=spec.use_ptx)
        out = jnp.where(seen[:, None], out, 0.0).astype(o_ref.dtype)
        pltriton.store(o_ref.at[t_idx, h_idx, lane], out, mask=rmask)
