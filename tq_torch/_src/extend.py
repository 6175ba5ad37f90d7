"""Path ``extend``: query-row tiles x key tiles, one pass, output written by the tile
(prefill, chunked prefill, prefix-cached continuation, mixed batches; any q_len).
Rows outside ``[query_start_loc[0], query_start_loc[B])`` (padding) are zeroed by a second, tiny kernel.

See `attention_kernel` for the tiling. Tiles are tall (``BLOCK_M`` 64 rows on
the GPU) so long prefills reuse each dequantised key tile across many queries.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import config
from .attention_kernel import launch_tiles
from .launcher import kernel_site


@triton.jit
def _zero_padding_rows_kernel(out_ptr, qsl_ptr, stride_ot, stride_oh, num_seqs, num_q_heads,
                              HQ_PAD: tl.constexpr, D_PAD: tl.constexpr, D: tl.constexpr):
    """Zeros row ``t`` of ``out`` outside ``[query_start_loc[0], query_start_loc[B])`` (padding;
    no tile owns it)."""
    tok = tl.program_id(0)
    if (tok < tl.load(qsl_ptr)) | (tok >= tl.load(qsl_ptr + num_seqs)):
        h = tl.arange(0, HQ_PAD)
        d = tl.arange(0, D_PAD)
        ptrs = out_ptr + tok.to(tl.int64) * stride_ot + h[:, None] * stride_oh + d[None, :]
        zero = tl.zeros([HQ_PAD, D_PAD], tl.float32).to(out_ptr.dtype.element_ty)
        tl.store(ptrs, zero, mask=(h < num_q_heads)[:, None] & (d < D)[None, :])


def launch_extend(q, out, kv_cache, cache_i16, centroids, block_table, seq_lens, query_start_loc,
                  sinks, *, block_m: int, **common) -> None:
    """``q`` is the (rotated) query ``[T, Hq, D]``; ``out [T, Hq, D]`` is written in full."""
    launch_tiles(q, out, q, q, q, kv_cache, cache_i16, centroids, block_table, seq_lens, query_start_loc,
                 sinks, num_splits=1, split_kv=False, block_m=block_m, **common)
    t, hq, d = out.shape
    site = kernel_site(_zero_padding_rows_kernel,
                       dict(HQ_PAD=config.next_pow2(hq), D_PAD=common["d_pad"], D=d, num_warps=4))
    site((t,), (out, query_start_loc), (out.stride(0), out.stride(1), block_table.shape[0], hq))
