"""tq_jax: TurboQuant KV-cache store and paged attention as Pallas kernels (Triton lowering).

The same ops, argument order and semantics as `tq_torch`, over the byte format
of `tq_spec` (DESIGN.md). Compiled for cuda/rocm the kernels lower through
Triton; for any other platform (CPU) they run in Pallas interpret mode. The
choice is made per *lowering* platform (so `jax.export` for CUDA works from a
CPU host); ``interpret=True/False`` forces it.

* `store_kv(key, value, kv_cache, slot_mapping, *, preset, rotation=None, codebook=None,
  interpret=None, donate_cache=False)` -> the new cache (aliased: in place under
  ``jax.jit(..., donate_argnums=...)``, or eagerly with ``donate_cache=True``,
  which consumes the input cache).
* `paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, *, preset,
  scale=None, sliding_window=None, logits_soft_cap=None, sinks=None, rotation=None,
  codebook=None, path="auto", interpret=None)` -> ``[T, Hq, D]`` in the query dtype;
  padding rows past ``query_start_loc[B]`` are zeros, NaN in visible inputs propagates.
* `dequantize_cache(kv_cache, *, preset, head_dim, rotation=None, codebook=None)`
  -> ``(K, V)`` float32 (plain jnp, for debugging and tests).
* `PATHS`, `select_path`: the dispatch table shared with tq_torch (tq_spec.dispatch).
* `attention_compute_dtype(query_dtype)`: the dtype of the attention dot operands
  (the query's; float32 means IEEE fp32), for tolerance checks.
* `tq_jax.paging`: a jittable page allocator (free list, per-sequence pages,
  seq_lens, prefix sharing by reference count) and the per-step op metadata
  (block_table, seq_lens, query_start_loc, slot_mapping, positions,
  last-token indices) padded to a bucketed T.
* `tq_jax.nnx`: Flax NNX modules: `Attention` (projections, GQA, RoPE, window, soft
  cap, sinks, its own `nnx.Cache`, KV sharing), `init_cache`, cache sizing,
  `scan_layers`; `tq_jax.examples.generate`: a runnable decoder and greedy sampler.

Inputs are jax or numpy arrays (torch tensors are a TypeError naming the
argument); numpy integer metadata is converted to int32 when lossless. The
ops work under `jit`, `eval_shape`, `lax.scan`/`nnx.scan` and `jax.export`
(one platform per export); `jax.grad`/`jax.jvp` through them raise
NotImplementedError naming the op.
"""

from tq_spec.dispatch import PATH_NAMES, PATHS, DispatchProblem, select_path

from ._src.attention import attention_compute_dtype, paged_attention
from ._src.dequantize import dequantize_cache
from . import paging  # plain jax (tq_jax.nnx needs flax and is imported on demand)
from ._src.store import store_kv

__all__ = [
    "PATHS", "PATH_NAMES", "DispatchProblem", "attention_compute_dtype", "dequantize_cache", "paged_attention",
    "paging", "select_path", "store_kv",
]
