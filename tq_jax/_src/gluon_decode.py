"""tq_jax's launcher of the Gluon decode (`tq_gluon.decode`): the decode path's kernel on sm_90 where
`ineligible` allows it, as tq_torch's decode path runs it.

The kernel, its slot table and its launch shapes are shared with tq_torch (`tq_gluon.decode`): both
frameworks run the same kernel, compiled by the same Triton, launched here by jaxlib's Triton kernel
call inside the XLA program (`launcher`). Calls without an sm_90 GPU, jaxlib > 0.10.2 and the ``triton``
package, and calls the kernel does not read, keep the Pallas kernels of the decode path (`decode`).

Why (steps.md, forty-fourth session): on an H200 the Pallas decode ran B=32 x 8k 4bit_nc in 0.383 ms,
tq_torch 0.185 ms with this kernel. Pallas' Triton lowering cannot place the layouts that make this kernel
fast (each lane loads exactly the slot bytes its mma fragments hold; no shared memory in the key loop).

Buffers: the query, the cache (twice: as int16 words and as key words), the tables and the metadata are
the custom call's operands; the partials, the output and the fused merge's ticket counters its results
(`tq_gluon.decode.KERNEL_POINTERS`), the counters zeroed by jaxlib before each launch. Decode steps with
few splits merge in the kernel; otherwise the log2-domain partials go to `decode.merge_partials` in XLA.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

import tq_spec
from tq_gluon import decode as shared

from .launcher import kernel_call, unavailable


def ineligible(layout: tq_spec.Layout, *, query_dtype, num_tokens: int, num_seqs: int, num_q_heads: int,
               kv_cache_shape: tuple, interpret: bool) -> Optional[str]:
    """None where the decode path may run this kernel on these static facts, else why not.

    The per-call facts (no sliding window, no soft cap) are the caller's to check.
    """
    if interpret:
        return "needs a CUDA device (no interpreter)"
    why = shared.ineligible_shape(layout, num_tokens=num_tokens, num_seqs=num_seqs, num_q_heads=num_q_heads,
                                  kv_cache_shape=kv_cache_shape)
    if why is not None:
        return why
    if jnp.dtype(query_dtype) != jnp.bfloat16:
        return "needs a bfloat16 query and output"
    if layout.preset.key_format == "fp8" and layout.slot_bytes % 4:
        return "reads fp8 keys as int32 words: needs slots of a multiple of 4 bytes"
    return unavailable()


def num_splits(*, num_kv_heads: int, num_tokens: int, num_q_heads: int, num_seqs: int, max_context: int,
               head_dim: int) -> int:
    """`tq_gluon.decode.num_splits` on the first GPU's SMs."""
    from . import config

    return shared.num_splits(num_kv_heads=num_kv_heads, num_tokens=num_tokens, num_q_heads=num_q_heads,
                             num_seqs=num_seqs, max_context=max_context, sm_count=config.sm_count(),
                             max_splits=config._MAX_SPLITS, partials_budget=config._PARTIALS_BUDGET,
                             head_dim=head_dim)


def decode(q, kv_cache, centroids, block_table, seq_lens, query_start_loc, sinks, *, layout: tq_spec.Layout,
           scale: float, num_splits: int):
    """Decode attention -> ``[T, Hq, D]`` bfloat16 (padding rows unspecified: the caller zeroes them).

    ``q``: ``[T, Hq, D]`` bfloat16, rotated for mse keys (scores in the rotated space); ``kv_cache``: uint8
    ``[N, 16, Hkv, slot_bytes]``; ``centroids``: the fp32 key codebook (None for fp8 keys); ``block_table``
    int32 ``[B, max_blocks]``; ``seq_lens`` int32 ``[B]``; ``query_start_loc`` int32 ``[B + 1]``; ``sinks``
    None or fp32 ``[Hq]``; static shapes `ineligible` accepts. Any metadata values are safe (the kernel's
    guards, as in tq_torch).
    """
    from .decode import merge_partials

    t, hq, d = q.shape
    n, page, hkv, slot_bytes = kv_cache.shape
    num_seqs, max_blocks = block_table.shape
    shape = shared.launch_shape(layout, num_tokens=t, num_q_heads=hq, num_kv_heads=hkv, num_seqs=num_seqs,
                                max_blocks=max_blocks, num_splits=num_splits, has_sinks=sinks is not None)
    cs = (page * hkv * slot_bytes // 2, hkv * slot_bytes // 2, slot_bytes // 2)  # the int16 words' strides
    ks = cs if shape.slot["KEY_BITS"] != 8 else tuple(s // 2 for s in cs)  # fp8 keys: int32 words
    # The query arrives rotated (an XLA dot before the call), so the kernel never rotates it; XLA's buffers
    # are 16-byte aligned (jaxlib checks), so the cache starts at 0 mod 16.
    constexprs = dict(shape.constexprs, ROTATE=False, WIDE=shape.wide and shared.wide_loads(cs),
                      STAGES=shape.constexprs["STAGES"] if shared.tma_loads(cs) else 0)
    scalars = (hq * d, d, max_blocks, *cs, *ks, n, num_splits, hq, num_seqs, t,
               float(scale) * math.log2(math.e), shape.max_seq_len, hq * d, d, 0, 1.0)
    acc_n, m_n, _ = shape.part_sizes
    results = (jax.ShapeDtypeStruct((acc_n,), jnp.float32), jax.ShapeDtypeStruct((m_n,), jnp.float32),
               jax.ShapeDtypeStruct((m_n,), jnp.float32), jax.ShapeDtypeStruct((t, hq, d), jnp.bfloat16),
               jax.ShapeDtypeStruct((max(shape.tickets, 1),), jnp.int32),
               jax.ShapeDtypeStruct((max(shape.map_words, 1),), jnp.float32))  # the programs' tensor maps
    cb = centroids.astype(jnp.float32) if centroids is not None else jnp.zeros((1,), jnp.float32)  # fp8: unread
    sk = sinks.astype(jnp.float32) if sinks is not None else jnp.zeros((1,), jnp.float32)  # unread without sinks
    operands = (q, kv_cache, kv_cache, cb, block_table, seq_lens, query_start_loc, sk, q)  # rot_ptr: unread
    part_acc, part_m, part_l, out, _, _ = kernel_call(
        shared.gluon_decode_kernel, grid=shape.grid, signature=shared.kernel_signature(shape.slot),
        constexprs=constexprs, operands=operands, results=results, scalars=scalars,
        zeroed={4: 4 * shape.tickets})
    if shape.fused:
        return out
    s = num_splits
    # The kernel's partials are in the log2 domain; `merge_partials` takes natural-log maxima.
    return merge_partials(part_acc.reshape(t, hq, s, d), part_m.reshape(t, hq, s) * np.float32(math.log(2.0)),
                          part_l.reshape(t, hq, s), sinks=sinks, out_dtype=jnp.bfloat16)
