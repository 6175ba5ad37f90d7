"""Thin Flax NNX modules over `tq_jax.store_kv` and `tq_jax.paged_attention`.

* `PagedKVCache`: one layer's paged TurboQuant cache held as an `nnx.Cache`
  variable (``uint8[N, P, Hkv, slot_bytes]``), plus the preset's rotation.
* `PagedAttention`: stores the step's new K/V into a `PagedKVCache` and attends
  over it, with the layer's static settings (window, soft cap, scale) and
  optional learned sinks (an `nnx.Param` of float32 ``[Hq]``).

Under `nnx.jit` the cache update is an ordinary state update; donate the
module state to let XLA update the cache buffer in place.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import tq_spec

from ._src.attention import paged_attention
from ._src.store import store_kv


class PagedKVCache(nnx.Module):
    """The paged cache of one attention layer.

    Args:
      num_blocks, block_size, num_kv_heads: cache geometry ``[N, P, Hkv, ...]``.
      head_dim: D (must suit the preset, see `tq_spec.layout`).
      preset: preset name or `tq_spec.Preset`.
      rotation: mse presets only: None (tq_spec's Hadamard) or float ``[D, D]``
        (e.g. ``tq_spec.rotation(D, "randomized_hadamard", seed=...)``).
      codebook: mse presets only: None or a `tq_spec.Codebook`.
    """

    def __init__(self, *, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, preset,
                 rotation=None, codebook=None):
        lay = tq_spec.layout(preset, head_dim)
        tq_spec.quant_params(lay.preset, head_dim, rotation=rotation, codebook=codebook)  # validate early
        self.preset = lay.preset.name
        self.head_dim = head_dim
        self.codebook = codebook
        self.rotation = None if rotation is None else nnx.Variable(jnp.asarray(rotation, jnp.float32))
        self.kv_cache = nnx.Cache(jnp.zeros((num_blocks, block_size, num_kv_heads, lay.slot_bytes), jnp.uint8))

    def _rotation(self):
        return None if self.rotation is None else self.rotation[...]

    def store(self, key, value, slot_mapping) -> None:
        """Quantizes ``key/value [T, Hkv, D]`` into the slots of ``slot_mapping [T]`` (-1 skips)."""
        self.kv_cache[...] = store_kv(key, value, self.kv_cache[...], slot_mapping, preset=self.preset,
                                      rotation=self._rotation(), codebook=self.codebook)

    def attend(self, query, block_table, seq_lens, query_start_loc, *, scale=None, sliding_window=None,
               logits_soft_cap=None, sinks=None, path="auto"):
        """`tq_jax.paged_attention` over this cache; returns ``[T, Hq, D]`` in the query dtype."""
        return paged_attention(query, self.kv_cache[...], block_table, seq_lens, query_start_loc,
                               preset=self.preset, scale=scale, sliding_window=sliding_window,
                               logits_soft_cap=logits_soft_cap, sinks=sinks, rotation=self._rotation(),
                               codebook=self.codebook, path=path)


class PagedAttention(nnx.Module):
    """Store-then-attend for one layer: ``out = attend(query | cache + new K/V)``.

    Args:
      num_q_heads: Hq (sizes the sinks).
      scale, sliding_window, logits_soft_cap: static per-layer settings
        (DESIGN.md section 3).
      use_sinks: learn one sink logit per query head (initialised to 0).
      path: attention path override (``"auto"``, ``"decode"``, ``"extend"``).
    """

    def __init__(self, *, num_q_heads: int, scale=None, sliding_window=None, logits_soft_cap=None,
                 use_sinks: bool = False, path: str = "auto"):
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.path = path
        self.sinks = nnx.Param(jnp.zeros((num_q_heads,), jnp.float32)) if use_sinks else None

    def __call__(self, cache: PagedKVCache, query, key, value, slot_mapping, block_table, seq_lens,
                 query_start_loc):
        """Writes this step's ``key/value [T, Hkv, D]`` into `cache`, then attends ``query [T, Hq, D]``."""
        cache.store(key, value, slot_mapping)
        return cache.attend(query, block_table, seq_lens, query_start_loc, scale=self.scale,
                            sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap,
                            sinks=None if self.sinks is None else self.sinks[...], path=self.path)
