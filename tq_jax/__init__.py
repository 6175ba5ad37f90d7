"""tq_jax: TurboQuant KV-cache store and paged attention as Pallas kernels (Triton lowering).

The same ops, argument order and semantics as `tq_torch`, over the byte format
of `tq_spec` (DESIGN.md). On a CPU backend the kernels run in Pallas interpret
mode; on a CUDA backend they lower through Triton.

* `store_kv(key, value, kv_cache, slot_mapping, *, preset, rotation=None, codebook=None)`
  -> the new cache (aliased: in place under ``jax.jit(..., donate_argnums=...)``).
* `paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, *, preset,
  scale=None, sliding_window=None, logits_soft_cap=None, sinks=None, rotation=None,
  codebook=None, path="auto")` -> ``[T, Hq, D]`` in the query dtype.
* `dequantize_cache(kv_cache, *, preset, head_dim, rotation=None, codebook=None)`
  -> ``(K, V)`` float32 (plain jnp, for debugging and tests).
* `PATHS`, `select_path`: the dispatch table shared with tq_torch (tq_spec.dispatch).
* `attention_compute_dtype(query_dtype)`: the dtype of the attention dot operands
  (the query's; float32 means IEEE fp32), for tolerance checks.
* `tq_jax.nnx`: thin Flax NNX modules over these ops.
"""

from tq_spec.dispatch import PATH_NAMES, PATHS, DispatchProblem, select_path

from ._src.attention import attention_compute_dtype, paged_attention
from ._src.dequantize import dequantize_cache
from ._src.store import store_kv

__all__ = [
    "PATHS", "PATH_NAMES", "DispatchProblem", "attention_compute_dtype", "dequantize_cache", "paged_attention",
    "select_path", "store_kv",
]
