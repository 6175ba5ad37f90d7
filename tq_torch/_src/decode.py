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

import torch
import triton
import triton.language as tl

from .kv_tiles import LOG2E
from .attention_kernel import launch_tiles
from .kernel_math import to_dtype_rne


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
    # Rows past query_start_loc[B] are padding (CUDA-graph / bucketed batches):
    # no split wrote their partials, so they read nothing and come out zero.
    real = tok < tl.load(qsl_ptr + num_seqs)
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


def launch_decode(q, out, kv_cache, cache_i16, centroids, block_table, seq_lens, query_start_loc,
                  sinks, *, num_splits: int, block_m: int, **common) -> None:
    """Launches split + merge. ``q`` is the (rotated) query ``[T, Hq, D]``; ``out`` is written in full."""
    t, hq, d = q.shape
    dev = q.device
    # One allocation for the three partial buffers (host time matters at B=1).
    rows = t * hq * num_splits
    parts = torch.empty(rows * (d + 2), dtype=torch.float32, device=dev)
    part_acc = parts[: rows * d].view(t, hq, num_splits, d)
    part_m = parts[rows * d: rows * (d + 1)].view(t, hq, num_splits)
    part_l = parts[rows * (d + 1):].view(t, hq, num_splits)
    launch_tiles(q, out, part_acc, part_m, part_l, kv_cache, cache_i16, centroids, block_table, seq_lens,
                 query_start_loc, sinks, num_splits=num_splits, split_kv=True, block_m=block_m, **common)
    splits_pad = max(2, 1 << (num_splits - 1).bit_length())
    _decode_merge_kernel[(t, hq)](
        part_acc, part_m, part_l, sinks if sinks is not None else part_m, out, query_start_loc,
        out.stride(0), out.stride(1), hq, num_splits, block_table.shape[0],
        SPLITS_PAD=splits_pad, D=d, D_PAD=common["d_pad"],
        HAS_SINKS=sinks is not None, OUT_DTYPE=common["out_dtype"], INTERPRET=common["interpret"],
        num_warps=4,
    )
