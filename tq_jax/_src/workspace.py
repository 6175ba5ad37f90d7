"""Path ``dequant``: every page the batch can see, dequantised once into a 16-bit
K/V workspace, then the extend tiles over that workspace as a raw cache.

The extend path dequantises each key tile once per query-row tile, so a long
prefill decodes every key many times. Here each page is decoded once (plain
jnp: XLA fuses the gather and the decode) into ``workspace [B * max_blocks,
P, Hkv, 4 * D]`` bytes in the raw preset layout of the query's dtype
(``bf16``/``fp16``: D keys then D values):

* keys in scoring space, ``k = factor * c`` (mse: rotated space, factor
  ``norm`` or ``norm / ||c||``; the query is rotated as on every path),
* values ``code * scale + zero``,

both rounded once to the query dtype, which is how the dots round them on the
other paths too (``tq_spec.reference.emulate_paged_attention``). Entry
``(b, j)`` of the block table becomes workspace page ``b * max_blocks + j``
when page ``j`` holds keys of sequence ``b`` and its id is in ``[0, N)``, else
-1. Same design as ``tq_torch/_src/workspace.py``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .dequantize import scoring_space_kv


def workspace_preset(query_dtype) -> str:
    """The raw preset whose layout the workspace uses: the query's 16-bit dtype."""
    return {"bfloat16": "bf16", "float16": "fp16"}[jnp.dtype(query_dtype).name]


def dequantize_pages(kv_cache, block_table, seq_lens, centroids, *, preset_name: str, head_dim: int,
                     ws_dtype):
    """Decodes every page the block table names for its sequence into a raw 16-bit cache.

    Args:
      kv_cache: ``uint8[N, P, Hkv, slot_bytes]``; block_table ``int32[B, max_blocks]``;
        seq_lens ``int32[B]``; centroids: the codebook (mse presets) or None.
      ws_dtype: bfloat16 or float16, the query's dtype.

    Returns:
      ``(workspace uint8[B * max_blocks, P, Hkv, 4 * D], table int32[B, max_blocks])`` in the
      raw layout of `workspace_preset`, and its block table (-1 where unused).
    """
    n, page, hkv, _ = kv_cache.shape
    b, max_blocks = block_table.shape
    lens = jnp.clip(seq_lens, 0, max_blocks * page)
    col = lax.broadcasted_iota(jnp.int32, (b, max_blocks), 1)
    used = (col * page < lens[:, None]) & (block_table >= 0) & (block_table < n)
    pages = kv_cache[jnp.where(used, block_table, 0).reshape(-1)]
    k, v = scoring_space_kv(pages, centroids, preset_name=preset_name, head_dim=head_dim)
    kv = jnp.concatenate([k.astype(ws_dtype), v.astype(ws_dtype)], axis=-1)
    workspace = lax.bitcast_convert_type(kv, jnp.uint8).reshape(kv.shape[:-1] + (4 * head_dim,))
    table = jnp.where(used, lax.broadcasted_iota(jnp.int32, (b, max_blocks), 0) * max_blocks + col, -1)
    return workspace, table.astype(jnp.int32)

