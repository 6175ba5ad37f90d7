"""Path ``dequant``: every page the batch can see, dequantised once into a 16-bit
K/V workspace, then the extend tiles over that workspace as a raw cache.

The extend path dequantises each key tile once per query-row tile, so a long
prefill decodes every key hundreds of times. Here each page is decoded once
(`_dequantize_pages_kernel`, one program per (block-table entry, kv head)) into
``workspace [B * max_blocks, P, Hkv, 4 * D]`` bytes holding the raw preset
layout of the query's dtype (``bf16``/``fp16``: D keys then D values):

* keys in scoring space, ``k = factor * c`` (mse: rotated space, factor
  ``norm`` or ``norm / ||c||``; the query is rotated as on every path),
* values ``code * scale + zero``,

both rounded once to the query dtype, which is how the dots round them on the
other paths' tensor cores too (``tq_spec.reference.emulate_paged_attention``).
Entry ``(b, j)`` of the block table becomes workspace page ``b * max_blocks + j``
when page ``j`` holds keys of sequence ``b`` and its id is in ``[0, N)``, else
-1, which the attention kernel masks (the metadata guards of the other paths).

Shapes are static (the workspace covers the whole block table), so the path
is CUDA-graph capturable; `tq_spec.dispatch` bounds the workspace size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import tq_spec

from . import config
from .extend import launch_extend
from .kernel_math import to_dtype_rne
from .kv_tiles import decode_key_tile, decode_value_tile, fetch_kv_tile
from .launcher import kernel_site


@triton.jit
def _dequantize_pages_kernel(
    cache_i16, cb_ptr, bt_ptr, seq_lens_ptr, ws_ptr, ws_bt_ptr,
    stride_bt, stride_cn, stride_cp, stride_ch, stride_wn, stride_wp, stride_wh, max_blocks, num_blocks,
    PAGE_SIZE: tl.constexpr, P_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    KEY_FORMAT: tl.constexpr, KEY_FIELD_BITS: tl.constexpr, NORM_CORRECTION: tl.constexpr,
    KEY_NORM_OFF: tl.constexpr, VALUE_FORMAT: tl.constexpr, VALUE_FIELD_BITS: tl.constexpr,
    VALUE_OFF: tl.constexpr, VALUE_SCALE_OFF: tl.constexpr, VALUE_ZERO_OFF: tl.constexpr,
    RAW_DTYPE: tl.constexpr, WS_DTYPE: tl.constexpr, INTERPRET: tl.constexpr,
):
    page = tl.program_id(0)  # b * max_blocks + j
    head = tl.program_id(1).to(tl.int64)
    b = page // max_blocks
    j = page % max_blocks
    seq_len = tl.minimum(tl.maximum(tl.load(seq_lens_ptr + b), 0), max_blocks * PAGE_SIZE)
    blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + j)
    used = (j * PAGE_SIZE < seq_len) & (blk >= 0) & (blk < num_blocks)
    if head == 0:
        tl.store(ws_bt_ptr + page, tl.where(used, page, -1))
    if used:
        p = tl.arange(0, P_PAD)
        in_page = p < PAGE_SIZE
        slot = (blk.to(tl.int64) * stride_cn + p.to(tl.int64) * stride_cp + head * stride_ch) >> 1  # words
        ka, kb, kc, knorm, va, vb, vc, vscale, vzero = fetch_kv_tile(
            cache_i16 + slot, in_page, D, D_PAD, KEY_FORMAT, KEY_FIELD_BITS, KEY_NORM_OFF,
            VALUE_FORMAT, VALUE_FIELD_BITS, VALUE_OFF, VALUE_SCALE_OFF, VALUE_ZERO_OFF)
        k, k_factor = decode_key_tile(ka, kb, kc, knorm, cb_ptr, in_page, 1.0, KEY_FORMAT, KEY_FIELD_BITS,
                                      NORM_CORRECTION, RAW_DTYPE, tl.float32, 0, INTERPRET)
        v, v_scale, v_zero = decode_value_tile(va, vb, vc, vscale, vzero, in_page, VALUE_FORMAT,
                                               VALUE_FIELD_BITS, RAW_DTYPE)
        k = k * k_factor[:, None]
        if VALUE_FORMAT != 0:
            v = v * v_scale[:, None] + v_zero[:, None]
        d = tl.arange(0, D_PAD)
        mask = in_page[:, None] & (d < D)[None, :]
        row = ws_ptr + page.to(tl.int64) * stride_wn + p.to(tl.int64)[:, None] * stride_wp + head * stride_wh
        tl.store(row + d[None, :], to_dtype_rne(k, WS_DTYPE, INTERPRET), mask=mask)
        tl.store(row + D + d[None, :], to_dtype_rne(v, WS_DTYPE, INTERPRET), mask=mask)


def workspace_preset(query_dtype: torch.dtype) -> str:
    """The raw preset whose layout the workspace uses: the query's 16-bit dtype."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}[query_dtype]


def dequantize_pages(kv_cache, cache_i16, centroids, block_table, seq_lens, *, fmt: dict, d_pad: int,
                     ws_dtype: torch.dtype, interpret: bool):
    """Decodes every page the block table names for its sequence into a raw 16-bit cache.

    Returns ``(workspace uint8[B * max_blocks, P, Hkv, 4 * D], table int32[B, max_blocks])``:
    the workspace in the raw layout of `workspace_preset` (``ws_dtype``) and its block table
    (-1 for entries past a sequence's pages or naming a block outside the cache).
    """
    b, max_blocks = block_table.shape
    n, page, hkv, _ = kv_cache.shape
    d = fmt["D"]
    ws = torch.empty((b * max_blocks, page, hkv, 2 * d), dtype=ws_dtype, device=kv_cache.device)
    ws_table = torch.empty((b, max_blocks), dtype=torch.int32, device=kv_cache.device)
    site = kernel_site(_dequantize_pages_kernel, dict(
        PAGE_SIZE=page, P_PAD=config.next_pow2(page), D_PAD=d_pad, WS_DTYPE=config.TORCH_TO_TL[ws_dtype],
        INTERPRET=interpret, num_warps=4, **config.field_bits_constexprs(fmt)))
    site((b * max_blocks, hkv), (cache_i16, centroids, block_table, seq_lens, ws, ws_table),
         (block_table.stride(0), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
          ws.stride(0), ws.stride(1), ws.stride(2), max_blocks, n))
    return ws.view(torch.uint8), ws_table


def launch_dequant(q, out, kv_cache, cache_i16, centroids, block_table, seq_lens, query_start_loc, sinks,
                   *, fmt: dict, raw_tiles: dict, **common) -> None:
    """Dequantises the batch's pages, then runs the extend tiles over the workspace.

    ``q`` is the (rotated) query ``[T, Hq, D]``; ``out [T, Hq, D]`` is written in full;
    ``raw_tiles`` are the extend tile settings of raw 16-bit keys.
    """
    ws_dtype = {tl.bfloat16: torch.bfloat16, tl.float16: torch.float16}[common["dot_dtype"]]
    ws, ws_table = dequantize_pages(kv_cache, cache_i16, centroids, block_table, seq_lens, fmt=fmt,
                                    d_pad=common["d_pad"], ws_dtype=ws_dtype, interpret=common["interpret"])
    raw_fmt = config.format_constexprs(tq_spec.layout(workspace_preset(ws_dtype), fmt["D"]))
    common = dict(common, num_warps=raw_tiles["num_warps"], num_stages=raw_tiles["num_stages"],
                  maxnreg=raw_tiles["maxnreg"], prefetch=raw_tiles["prefetch"], block_n=raw_tiles["block_n"])
    # The kernel reads the workspace through a view in its own 16-bit float type: the raw K/V
    # tiles then feed the dots straight from the pipelined copy in shared memory, where int16
    # words would come into registers for the bitcast and go back (tq_jax's float view,
    # `cache_access.CacheWords.load_halves`).
    launch_extend(q, out, ws, ws.view(ws_dtype), centroids, ws_table, seq_lens, query_start_loc, sinks,
                  fmt=raw_fmt, block_m=raw_tiles["extend_block_m"], **common)
