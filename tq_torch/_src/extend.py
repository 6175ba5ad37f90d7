"""Path ``extend``: query-row tiles x key tiles, one pass, output written by the tile
(prefill, chunked prefill, prefix-cached continuation, mixed batches; any q_len).

See `attention_kernel` for the tiling. Tiles are tall (``BLOCK_M`` 64 rows on
the GPU) so long prefills reuse each dequantised key tile across many queries.
"""

from __future__ import annotations

from .attention_kernel import launch_tiles


def launch_extend(q, out, kv_cache, cache_i16, centroids, block_table, seq_lens, query_start_loc,
                  sinks, *, block_m: int, **common) -> None:
    """``q`` is the (rotated) query ``[T, Hq, D]``; ``out [T, Hq, D]`` is written in full."""
    launch_tiles(q, out, q, q, q, kv_cache, cache_i16, centroids, block_table, seq_lens, query_start_loc,
                 sinks, num_splits=1, split_kv=False, block_m=block_m, **common)
