"""Path ``dequant``: every page the batch can see, dequantised once into a 16-bit
K/V workspace, then the extend tiles over that workspace as a raw cache.

The extend path dequantises each key tile once per query-row tile, so a long
prefill decodes every key many times. Here each page is decoded once
(`_dequantize_pages_kernel`, one program per (block-table entry, kv head), the
attention kernel's own tile fetch and decode) into ``workspace [B * max_blocks,
P, Hkv, 2 * D]`` elements of the query's dtype, the slots of that dtype's raw preset
(``bf16``/``fp16``: D keys then D values):

* keys in scoring space, ``k = factor * c`` (mse: rotated space, factor
  ``norm`` or ``norm / ||c||``; the query is rotated as on every path),
* values ``code * scale + zero``,

both decoded in float32 and rounded once to the query dtype, which is how the
dots round them on the other paths too (``tq_spec.reference.emulate_paged_attention``).
Entry ``(b, j)`` of the block table becomes workspace page ``b * max_blocks + j``
when page ``j`` holds keys of sequence ``b`` and its id is in ``[0, N)``, else
-1; the kernel writes only those pages (the attention kernel masks the rest).
Same design as ``tq_torch/_src/workspace.py``. (Plain jnp for this step, XLA's
fusion of a gather and the decode, took 3x the kernel's time on an H100:
docs/bench/steps.md, session 20.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import tq_spec

from . import config
from . import kernel_math as km
from .cache_access import CacheWords
from .kv_tiles import TileSpec, decode_key_tile, decode_value_tile, fetch_kv_tile, key_tables
from .platform import pallas_kwargs


def workspace_preset(query_dtype) -> str:
    """The raw preset whose layout the workspace uses: the query's 16-bit dtype."""
    return {"bfloat16": "bf16", "float16": "fp16"}[jnp.dtype(query_dtype).name]


def dequantize_pages(cache, block_table, seq_lens, centroids, *, preset_name: str, head_dim: int,
                     ws_dtype, word_view: bool, interpret: bool):
    """Decodes every page the block table names for its sequence into a raw 16-bit cache.

    Args:
      cache: the cache as the attention kernels address it: ``uint8[N, P, Hkv, slot_bytes]``,
        or its ``uint16`` view when `word_view` (`cache_access`); block_table
        ``int32[B, max_blocks]``; seq_lens ``int32[B]``; centroids: the codebook (mse presets) or None.
      ws_dtype: bfloat16 or float16, the query's dtype.
      word_view: whether `cache` is the uint16 view.
      interpret: Pallas interpret mode (CPU) or the Triton lowering.

    Returns:
      ``(workspace ws_dtype[B * max_blocks, P, Hkv, 2 * D], table int32[B, max_blocks])``: the
      slots of `workspace_preset`'s raw layout as 16-bit elements (the attention kernels take
      it as a float word view, `cache_access.CacheWords.load_halves`), and its block table (-1
      where unused). Pages whose entry is -1 are not written (their elements are unspecified).
    """
    n, page, hkv, _ = cache.shape
    b, max_blocks = block_table.shape
    lay = tq_spec.layout(preset_name, head_dim)
    d_pad = config.padded_head_dim(head_dim)
    spec = TileSpec(
        lay=lay, access=CacheWords(word_view), block_size=int(page), num_blocks=int(n),
        max_blocks=int(max_blocks), block_n=_keys_per_step(int(page), d_pad), head_dim_padded=d_pad,
        compute_dtype="float32", prefetch=False, use_ptx=not interpret,
        fp8_convert=config.fp8_hardware_convert(interpret), shuffle_lookup=False)
    operands = [cache, block_table, seq_lens]
    has_tables = lay.preset.key_format == "mse"
    if has_tables:  # float32 pair tables: keys decode exactly, then round once to ws_dtype
        operands.append(key_tables(centroids, lay.preset.key_bits, jnp.float32, lay.preset.norm_correction))
    ws = pl.pallas_call(
        functools.partial(_dequantize_pages_kernel, spec=spec, has_tables=has_tables),
        out_shape=jax.ShapeDtypeStruct((b * max_blocks, page, hkv, 2 * head_dim), ws_dtype),
        grid=(b * max_blocks, hkv),
        **pallas_kwargs(interpret=interpret, name="tq_dequantize_pages", num_warps=4),
    )(*operands)
    col = lax.broadcasted_iota(jnp.int32, (b, max_blocks), 1)
    lens = jnp.clip(seq_lens, 0, max_blocks * page)[:, None]
    table = jnp.where(_holds_keys(block_table, lens, col, page, n),
                      lax.broadcasted_iota(jnp.int32, (b, max_blocks), 0) * max_blocks + col, -1)
    return ws, table.astype(jnp.int32)


def _keys_per_step(page: int, d_pad: int) -> int:
    """Keys one step of `_dequantize_pages_kernel` decodes: the page (rounded up to a power of
    two), at most 4096 elements of a float32 ``[keys, Dp]`` tile (32 registers per thread per
    tile at 4 warps), so large pages at large head dims loop instead of spilling."""
    return max(1, min(km.next_pow2(page), 4096 // d_pad))


def _holds_keys(blk, seq_len, col, page: int, num_blocks: int):
    """Block-table entry ``blk`` in column ``col`` holds keys of its sequence (``seq_len``
    clamped to what the table addresses) and names a page inside the cache."""
    return (col * page < seq_len) & (blk >= 0) & (blk < num_blocks)


def _dequantize_pages_kernel(*refs, spec: TileSpec, has_tables: bool):
    """Program ``(b * max_blocks + j, kv head)``: page ``j`` of sequence ``b``, one head, in steps
    of ``block_n`` keys through the attention kernel's fetch and decode (float32 operands)."""
    cache_ref, bt_ref, sl_ref = refs[:3]
    tab_ref = refs[3] if has_tables else None
    ws_ref = refs[-1]
    entry = pl.program_id(0)  # b * max_blocks + j
    kv_head = pl.program_id(1)
    b = km.div_nonneg(entry, spec.max_blocks)
    j = entry - b * spec.max_blocks
    seq_len = jnp.clip(sl_ref[b], 0, spec.max_blocks * spec.block_size)
    blk = bt_ref[b, j]
    d, dp, bn, page = spec.head_dim, spec.head_dim_padded, spec.block_n, spec.block_size
    lane = lax.broadcasted_iota(jnp.int32, (1, dp), 1)

    def step(i, carry):
        start = i * bn
        key = start + lax.broadcasted_iota(jnp.int32, (bn,), 0)
        in_page = key < page
        raw = fetch_kv_tile(spec, cache_ref, jnp.where(in_page, blk, -1), start, kv_head, in_page)
        parts, factor = decode_key_tile(spec, raw, tab_ref, bn)
        k = km.interleave(*parts) if len(parts) == 2 else parts[0]  # mse: even and odd elements
        if factor is not None:
            k = k * factor[:, None]
        v, scale, zero, _ = decode_value_tile(spec, raw)  # float32 codes: bias 0
        if scale is not None:
            v = v * scale[:, None] + zero[:, None]
        mask = in_page[:, None] & (lane < d)
        # Unclamped key/lane indices: every lane has its own address (interpret mode
        # implements a masked store as read-modify-write of every lane).
        pltriton.store(ws_ref.at[entry, key[:, None], kv_head, lane], k.astype(ws_ref.dtype), mask=mask)
        pltriton.store(ws_ref.at[entry, key[:, None], kv_head, d + lane], v.astype(ws_ref.dtype), mask=mask)
        return carry

    @pl.when(_holds_keys(blk, seq_len, j, page, spec.num_blocks))
    def _page():
        lax.fori_loop(0, (page + bn - 1) // bn, step, 0)
