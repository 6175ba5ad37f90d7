"""tq_torch: TurboQuant KV-cache store and paged attention in PyTorch + Triton.

Public API (same names and argument order as `tq_spec.reference` and `tq_jax`):

* `store_kv(key, value, kv_cache, slot_mapping, *, preset, rotation=None, codebook=None)`
* `paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, *, preset, scale=None,
  sliding_window=None, logits_soft_cap=None, sinks=None, rotation=None, codebook=None, path="auto")`
* `dequantize_cache(kv_cache, *, preset, head_dim, rotation=None, codebook=None)`

Both kernels are registered as ``torch.ops.tq_torch.store_kv`` and
``torch.ops.tq_torch.paged_attention`` (usable under ``torch.compile``). The
attention paths and their eligibility are the shared table
`tq_spec.dispatch.PATHS` (re-exported here as `PATHS`).
"""

from tq_spec.dispatch import PATH_NAMES, PATHS

from ._src.api import paged_attention, store_kv
from ._src.dequantize import dequantize_cache

__all__ = ["PATHS", "PATH_NAMES", "dequantize_cache", "paged_attention", "store_kv"]
