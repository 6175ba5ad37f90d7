"""Path ``decode``: split-KV attention with a log-sum-exp merge.

Kernel 1 (`attention_kernel` with ``SPLIT_KV``) runs one program per
(query tile, kv head, split). Decode tiles are short: ``BLOCK_M`` is the GQA
group padded to a power of two >= 16 (tensor-core dots), so a decode step
(q_len = 1) is one tile per (sequence, kv head) and each K/V element of a split
is dequantised once for the whole group. Longer q_len simply gives a sequence
more tiles, so the path is correct for any q_len. Each tile's key range
(causal end, window start) is cut into ``num_splits`` equal, BLOCK_N-aligned
chunks; chunks past the end are empty and write ``m = -inf, l = 0, acc = 0``.

Kernel 2 merges the splits per (token, query head), adds sinks to the
denominator, and writes the output (zeros for rows that saw no key).

Buffers have static shapes ``[T, Hq, num_splits, ...]`` and ``num_splits``
depends only on static shapes, so the path can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .kv_tiles import LOG2E
from .attention_kernel import tiles_launch, tiles_spec
from .kernel_math import to_dtype_rne
from .launcher import Launch, kernel_site


@triton.jit
def _decode_merge_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, sinks_ptr, out_ptr, qsl_ptr, stride_ot, stride_oh,
    num_q_heads, num_splits, num_seqs, SPLITS_PAD: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, HAS_SINKS: tl.constexpr,
    OUT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    # Rows outside [query_start_loc[0], query_start_loc[B]) are padding (CUDA-graph /
    # bucketed batches): no split wrote their partials, so they read nothing and come out zero.
    real = (tok >= tl.load(qsl_ptr)) & (tok < tl.load(qsl_ptr + num_seqs))
    smask = s < tl.where(real, num_splits, 0)
    part = (tok * num_q_heads + head) * num_splits + s
    m = tl.load(part_m_ptr + part, mask=smask, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=smask, other=0.0)
    m_all = tl.max(m, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * LOG2E
        m_all = tl.maximum(m_all, sink)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    # Empty splits have m = -inf: weight exactly 0, they merge as nothing.
    w = tl.exp2(m - m_safe)
    denom = tl.sum(w * l, axis=0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m_safe)
    acc = tl.load(part_acc_ptr + part[:, None] * D + d[None, :],
                  mask=smask[:, None] & (d < D)[None, :], other=0.0)
    o = tl.sum(w[:, None] * acc, axis=0)
    # `!= 0`, not `> 0`: a NaN denominator (NaN query or sink) must give NaN.
    denom_v = tl.zeros_like(o) + denom
    o = tl.where(denom_v != 0.0, tl.math.div_rn(o, tl.where(denom_v != 0.0, denom_v, 1.0)), 0.0)
    o = tl.where(real, o, 0.0)
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + d, to_dtype_rne(o, OUT_DTYPE, INTERPRET),
             mask=d < D)


def decode_spec(*, num_tokens: int, num_q_heads: int, head_dim: int, num_seqs: int, num_splits: int,
                has_sinks: bool, **tiles) -> tuple:
    """The static part of a decode launch (split + merge), for `launch_decode_spec`.

    ``tiles`` are `attention_kernel.tiles_spec`'s remaining keywords. Depends on
    static shapes and settings only, so callers cache it.
    """
    t, hq, d = num_tokens, num_q_heads, head_dim
    rows = t * hq * num_splits
    split = tiles_spec(num_tokens=t, num_q_heads=hq, num_seqs=num_seqs, num_splits=num_splits, split_kv=True,
                       has_sinks=has_sinks, **tiles)
    merge = kernel_site(_decode_merge_kernel, dict(
        SPLITS_PAD=max(2, 1 << (num_splits - 1).bit_length()), D=d, D_PAD=tiles["d_pad"], HAS_SINKS=has_sinks,
        OUT_DTYPE=tiles["out_dtype"], INTERPRET=tiles["interpret"], num_warps=4))
    return split, (t, hq), rows * (d + 2), (rows * d, rows, rows), hq, num_splits, num_seqs, merge


def launch_decode_spec(spec: tuple, q, out, kv_cache, cache_i16, centroids, block_table, seq_lens,
                       query_start_loc, sinks, sm_scale: float, softcap: float, window: int,
                       first: Optional[Launch] = None) -> None:
    """Launches split + merge with a `decode_spec` of these tensors' static shapes; ``first`` (the query
    rotation that fills ``q``), if given, right before them (`launcher.Launch`)."""
    split, merge_grid, part_numel, part_sizes, hq, num_splits, num_seqs, merge = spec
    # One allocation for the three partial buffers, split in one call (host
    # time matters at B=1). The kernels index them flat: acc ``[T, Hq, splits,
    # D]``, m and l ``[T, Hq, splits]``.
    parts = torch.empty(part_numel, dtype=torch.float32, device=q.device)
    part_acc, part_m, part_l = torch.split_with_sizes(parts, part_sizes)
    os_ = out.stride()
    split_launch = tiles_launch(split, q, out, part_acc, part_m, part_l, kv_cache, cache_i16, centroids,
                                block_table, seq_lens, query_start_loc, sinks, sm_scale, softcap, window)
    if first is not None:
        first()
    split_launch()
    merge(merge_grid, (part_acc, part_m, part_l, sinks if sinks is not None else part_m, out, query_start_loc),
          (os_[0], os_[1], hq, num_splits, num_seqs))


def launch_decode(q, out, kv_cache, cache_i16, centroids, block_table, seq_lens, query_start_loc,
                  sinks, *, num_splits: int, block_m: int, fmt: dict, sm_scale: float, softcap: float,
                  window: int, **tiles) -> None:
    """Launches split + merge. ``q`` is the (rotated) query ``[T, Hq, D]``; ``out`` is written in full."""
    t, hq, d = q.shape
    spec = decode_spec(
        num_tokens=t, num_q_heads=hq, head_dim=d, num_seqs=block_table.shape[0], num_splits=num_splits,
        has_sinks=sinks is not None, num_kv_heads=kv_cache.shape[2], max_blocks=block_table.shape[1],
        num_blocks=kv_cache.shape[0], page_size=kv_cache.shape[1], fmt=fmt, block_m=block_m, **tiles)
    launch_decode_spec(spec, q, out, kv_cache, cache_i16, centroids, block_table, seq_lens, query_start_loc,
                       sinks, sm_scale, softcap, window)
