"""Path ``extend``: query-row tiles x key tiles, one pass, output written by the tile
(prefill, chunked prefill, prefix-cached continuation, mixed batches; any q_len).
Rows outside ``[query_start_loc[0], query_start_loc[B])`` (padding) are zeroed by a second, tiny kernel.

See `attention_kernel` for the tiling. Tiles are tall (``block_m`` 128 rows on
the GPU at head_dim <= 128) so long prefills reuse each decoded key tile across
many queries.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from . import kernel_math as km
from .attention_kernel import AttentionConfig, launch_tiles
from .platform import pallas_kwargs


def extend_attention(cfg: AttentionConfig, q, cache, block_table, seq_lens, query_start_loc, key_tables, sinks,
                     *, out_dtype, interpret, poison: bool = False):
    """Runs the kernel; returns ``[T, Hq, D]`` in `out_dtype`, written in full (padding rows zero)."""
    out = launch_tiles(cfg, q, cache, block_table, seq_lens, query_start_loc, key_tables, sinks,
                       out_dtype=out_dtype, interpret=interpret, poison=poison)
    return zero_padding_rows(out, query_start_loc, num_seqs=block_table.shape[0], interpret=interpret)


def zero_padding_rows(out, query_start_loc, *, num_seqs: int, interpret):
    """``out [T, Hq, D]`` with the rows outside ``[query_start_loc[0], query_start_loc[B])`` zeroed,
    in place (the output buffer is aliased; other rows are neither read nor written).

    One program per row: a select over the whole output (what XLA would fuse) reads and writes
    every row, 0.059 ms of an 8k prefill's 1.72 ms on an H100 (docs/bench/steps.md, session 30).
    """
    t, hq, d = out.shape
    return pl.pallas_call(
        functools.partial(_zero_padding_rows_kernel, num_seqs=num_seqs),
        out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
        input_output_aliases={1: 0},
        grid=(t,),
        **pallas_kwargs(interpret=interpret, name="tq_zero_padding_rows", num_warps=4),
    )(query_start_loc, out)


def _zero_padding_rows_kernel(qsl_ref, out_in_ref, o_ref, *, num_seqs: int):
    """Program ``t``: zeros row ``t`` of ``o_ref`` if no sequence owns it (tq_torch's kernel of the same name)."""
    del out_in_ref  # the same buffer as o_ref
    tok = pl.program_id(0)
    _, hq, d = o_ref.shape

    @pl.when((tok < qsl_ref[0]) | (tok >= qsl_ref[num_seqs]))
    def _zero():
        h = lax.broadcasted_iota(jnp.int32, (km.next_pow2(hq), 1), 0)
        lane = lax.broadcasted_iota(jnp.int32, (1, km.next_pow2(d)), 1)
        # Unclamped head/lane indices: every lane has its own address (interpret mode
        # implements a masked store as read-modify-write of every lane).
        pltriton.store(o_ref.at[tok, h, lane], jnp.zeros((h.shape[0], lane.shape[1]), o_ref.dtype),
                       mask=(h < hq) & (lane < d))
