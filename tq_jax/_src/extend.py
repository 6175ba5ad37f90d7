"""Path ``extend``: query-row tiles x key tiles, one pass, output written by the tile
(prefill, chunked prefill, prefix-cached continuation, mixed batches; any q_len).

See `attention_kernel` for the tiling. Tiles are tall (``block_m`` 128 rows on
the GPU at head_dim <= 128) so long prefills reuse each decoded key tile across
many queries. Padding rows are zeroed by the caller (one select, fused by XLA).
"""

from __future__ import annotations

from .attention_kernel import AttentionConfig, launch_tiles


def extend_attention(cfg: AttentionConfig, q, cache, block_table, seq_lens, query_start_loc, key_tables, sinks,
                     *, out_dtype, interpret, poison: bool = False):
    """Runs the kernel; returns ``[T, Hq, D]`` in `out_dtype` (padding rows unspecified)."""
    return launch_tiles(cfg, q, cache, block_table, seq_lens, query_start_loc, key_tables, sinks,
                        out_dtype=out_dtype, interpret=interpret, poison=poison)
