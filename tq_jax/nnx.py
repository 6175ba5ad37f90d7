"""Flax NNX modules over `tq_jax.store_kv` and `tq_jax.paged_attention`.

* `Attention`: a model author's attention layer. Projects ``x [T, E]`` to
  Q/K/V (GQA: ``Hq`` query heads over ``Hkv`` kv heads, any ratio), applies
  RoPE at ``meta.positions`` (built in, or your callable), stores the new K/V
  into its layer cache with `store_kv` and attends with `paged_attention`
  (sliding window, soft cap, learned sinks), then projects back. It takes the
  step metadata pytree of `tq_jax.paging.step_metadata` and owns its cache
  (an `nnx.Cache`), receives one per call, or reads another layer's cache
  (KV sharing / YOCO: ``kv_source=``).
* `PagedKVCache`: one layer's paged TurboQuant cache held as an `nnx.Cache`
  variable (``uint8[N, P, Hkv, slot_bytes]``), plus the preset's rotation;
  `init_cache` builds one. `DenseKVCache`: the same interface unquantized in
  plain jnp (a quality reference, not a fast path).
* `apply_rope`, `cache_bytes_per_token`, `pages_for_budget`: RoPE and cache sizing.
* `scan_layers`: `lax.scan` over a stack of identical layers (built with
  `nnx.vmap`) that carries the stacked caches instead of scanning over them,
  so the stack is updated in place (no second stacked buffer, see there).
* `PagedAttention`: the low-level store-then-attend over explicit arrays
  (kept for existing code; `Attention` is the model-level module).

Under `nnx.jit(..., donate_argnums=...)` donating the module (or its state)
lets XLA update each cache buffer in place: the step rewrites only the slots
named by ``slot_mapping`` and the buffer keeps its address (tested on CPU).
Per-layer preset and window are constructor arguments, so a stack may mix
them (e.g. bf16 boundary layers as vLLM does); `nnx.scan` needs identical
layers per group (the preset, window, soft cap are static).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from flax import nnx

import tq_spec

from ._src.attention import paged_attention
from ._src.store import store_kv

__all__ = [
    "Attention", "DenseKVCache", "PagedAttention", "PagedKVCache", "apply_rope", "cache_bytes_per_token",
    "init_cache", "pages_for_budget", "scan_layers",
]


# ------------------------------------------------------------------ sizing


def _presets(preset, num_layers):
    if isinstance(preset, (list, tuple)):
        return list(preset)
    return [preset] * num_layers


def cache_bytes_per_token(preset, *, head_dim: int, num_kv_heads: int, num_layers: int = 1) -> int:
    """Cache bytes one token occupies: ``sum over layers of Hkv * slot_bytes`` (K and V).

    Args:
      preset: a preset name / `tq_spec.Preset`, or a sequence of them, one per
        layer (then ``num_layers`` is ignored).
      head_dim: D; num_kv_heads: Hkv per layer; num_layers: layers with their own cache
        (KV-sharing layers add nothing).

    Example: ``cache_bytes_per_token("turboquant_4bit_nc", head_dim=128, num_kv_heads=8)`` is
    ``8 * 134 = 1072`` (bf16: ``8 * 512 = 4096``).
    """
    return sum(num_kv_heads * tq_spec.layout(p, head_dim).slot_bytes for p in _presets(preset, num_layers))


def pages_for_budget(budget_bytes: int, preset, *, head_dim: int, num_kv_heads: int, page_size: int,
                     num_layers: int = 1) -> int:
    """How many pages (``num_blocks``, shared by every layer's cache) fit in ``budget_bytes``.

    Each layer's cache is ``uint8[N, page_size, Hkv, slot_bytes]``; every
    layer gets the same N (the allocator hands out one page id for all
    layers). ``preset`` may be one preset or one per layer.
    """
    per_page = page_size * cache_bytes_per_token(preset, head_dim=head_dim, num_kv_heads=num_kv_heads,
                                                 num_layers=num_layers)
    return int(budget_bytes) // per_page


# ------------------------------------------------------------------ caches


class PagedKVCache(nnx.Module):
    """The paged cache of one attention layer.

    Args:
      num_blocks, block_size, num_kv_heads: cache geometry ``[N, P, Hkv, ...]``.
      head_dim: D (must suit the preset, see `tq_spec.layout`).
      preset: preset name or `tq_spec.Preset`.
      rotation: mse presets only: None (tq_spec's Hadamard) or float ``[D, D]``
        (e.g. ``tq_spec.rotation(D, "randomized_hadamard", seed=...)``).
      codebook: mse presets only: None or a `tq_spec.Codebook`.

    Attributes:
      kv_cache: `nnx.Cache` of ``uint8[N, P, Hkv, slot_bytes]`` (zeros initially).
    """

    def __init__(self, *, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, preset,
                 rotation=None, codebook=None):
        lay = tq_spec.layout(preset, head_dim)
        tq_spec.quant_params(lay.preset, head_dim, rotation=rotation, codebook=codebook)  # validate early
        self.preset = lay.preset.name
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.codebook = codebook
        self.rotation = None if rotation is None else nnx.Variable(jnp.asarray(rotation, jnp.float32))
        self.kv_cache = nnx.Cache(jnp.zeros((num_blocks, block_size, num_kv_heads, lay.slot_bytes), jnp.uint8))

    @property
    def nbytes(self) -> int:
        """Bytes of the cache buffer."""
        return int(self.kv_cache[...].size)

    def _rotation(self):
        return None if self.rotation is None else self.rotation[...]

    def store(self, key, value, slot_mapping) -> None:
        """Quantizes ``key/value [T, Hkv, D]`` into the slots of ``slot_mapping int32[T]`` (-1 skips)."""
        self.kv_cache[...] = store_kv(key, value, self.kv_cache[...], slot_mapping, preset=self.preset,
                                      rotation=self._rotation(), codebook=self.codebook)

    def attend(self, query, block_table, seq_lens, query_start_loc, *, scale=None, sliding_window=None,
               logits_soft_cap=None, sinks=None, path="auto"):
        """`tq_jax.paged_attention` over this cache; returns ``[T, Hq, D]`` in the query dtype."""
        return paged_attention(query, self.kv_cache[...], block_table, seq_lens, query_start_loc,
                               preset=self.preset, scale=scale, sliding_window=sliding_window,
                               logits_soft_cap=logits_soft_cap, sinks=sinks, rotation=self._rotation(),
                               codebook=self.codebook, path=path)


def init_cache(*, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, preset="turboquant_4bit_nc",
               rotation=None, codebook=None) -> PagedKVCache:
    """A zeroed `PagedKVCache` (``uint8[N, P, Hkv, slot_bytes]``); ``preset="dense"`` gives a `DenseKVCache`."""
    if preset == "dense":
        return DenseKVCache(num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                            head_dim=head_dim)
    return PagedKVCache(num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        preset=preset, rotation=rotation, codebook=codebook)


class DenseKVCache(nnx.Module):
    """Unquantized paged K/V in plain jnp, with `PagedKVCache`'s ``store``/``attend`` interface.

    A quality reference (the "dense" model of the example): K and V are kept
    in ``dtype`` (``[N, P, Hkv, 2, D]``, an `nnx.Cache`) and attention is a
    masked softmax over each sequence's gathered pages in float32, with the
    same semantics (causal, window, soft cap, sinks, padding rows zero).
    Memory and time grow with ``B * max_blocks * P``; not a serving path.
    """

    preset = "dense"

    def __init__(self, *, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.bfloat16):
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.kv_cache = nnx.Cache(jnp.zeros((num_blocks, block_size, num_kv_heads, 2, head_dim), dtype))

    @property
    def nbytes(self) -> int:
        c = self.kv_cache[...]
        return int(c.size * c.dtype.itemsize)

    def store(self, key, value, slot_mapping) -> None:
        c = self.kv_cache[...]
        n, p = c.shape[:2]
        flat = c.reshape((n * p,) + c.shape[2:])
        slots = jnp.where(slot_mapping < 0, n * p, slot_mapping)  # out of bounds: dropped
        kv = jnp.stack([key, value], axis=2).astype(c.dtype)
        self.kv_cache[...] = flat.at[slots].set(kv, mode="drop").reshape(c.shape)

    def attend(self, query, block_table, seq_lens, query_start_loc, *, scale=None, sliding_window=None,
               logits_soft_cap=None, sinks=None, path="auto"):
        del path
        c = self.kv_cache[...]
        t, hq, d = query.shape
        b_count, max_blocks = block_table.shape
        p, hkv = c.shape[1], c.shape[2]
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        rows = jnp.arange(t, dtype=jnp.int32)
        b = jnp.clip(jnp.searchsorted(query_start_loc, rows, side="right").astype(jnp.int32) - 1, 0, b_count - 1)
        real = (rows >= query_start_loc[0]) & (rows < query_start_loc[-1])
        q_len = query_start_loc[b + 1] - query_start_loc[b]
        pos = seq_lens[b] - q_len + (rows - query_start_loc[b])
        kv = c[block_table].reshape(b_count, max_blocks * p, hkv, 2, d).astype(jnp.float32)
        k, v = kv[b, :, :, 0], kv[b, :, :, 1]  # [T, L, Hkv, D]
        qg = query.astype(jnp.float32).reshape(t, hkv, hq // hkv, d)
        s = jnp.einsum("tkgd,tlkd->tkgl", qg, k) * scale
        if logits_soft_cap is not None:
            s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
        j = jnp.arange(max_blocks * p)[None, :]
        vis = (j <= pos[:, None]) & (j < seq_lens[b][:, None]) & real[:, None]
        if sliding_window is not None:
            vis &= j > pos[:, None] - sliding_window
        s = jnp.where(vis[:, None, None, :], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        if sinks is not None:
            m = jnp.maximum(m, sinks.astype(jnp.float32).reshape(1, hkv, hq // hkv, 1))
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        e = jnp.where(vis[:, None, None, :], jnp.exp(s - m), 0.0)
        den = jnp.sum(e, axis=-1, keepdims=True)
        if sinks is not None:
            den = den + jnp.exp(sinks.astype(jnp.float32).reshape(1, hkv, hq // hkv, 1) - m)
        out = jnp.einsum("tkgl,tlkd->tkgd", e, v) / jnp.where(den > 0, den, 1.0)
        out = jnp.where(jnp.any(vis, axis=-1)[:, None, None, None], out, 0.0)
        return out.reshape(t, hq, d).astype(query.dtype)


# ------------------------------------------------------------------ RoPE


def apply_rope(x, positions, *, theta: float = 10000.0):
    """Rotary embedding (rotate-half convention, Llama/Gemma/NeoX) at integer ``positions``.

    Args:
      x: ``[T, H, D]`` (D even), any float dtype; positions: ``int32[T]``
        (e.g. ``StepMetadata.positions``; padding rows have position 0).

    Returns:
      ``[T, H, D]`` in ``x.dtype`` (computed in float32).
    """
    d = x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d))
    ang = positions.astype(jnp.float32)[:, None] * inv[None, :]  # [T, D/2]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# ------------------------------------------------------------------ modules


class Attention(nnx.Module):
    """A paged-attention layer: projections, GQA, RoPE, store into the cache, attend, output projection.

    Args:
      embed_dim: E, model width; num_q_heads: Hq; num_kv_heads: Hkv (``Hq % Hkv == 0``,
        any ratio); head_dim: D (a power of two for the turboquant presets).
      rngs: `nnx.Rngs` for the projection weights.
      preset: the cache format of this layer (per layer: e.g. ``"bf16"`` for
        boundary layers); ``"dense"`` for the unquantized jnp reference.
      num_blocks, block_size: when both given the layer owns its cache
        (``self.cache``, see `init_cache`); otherwise pass ``cache=`` per call.
      kv_source: another `Attention` (or a cache module) whose cache this layer
        reads (KV sharing / YOCO): the layer projects only Q, stores
        nothing and owns no cache (``num_blocks`` is ignored); the source
        layer must run earlier in the same step.
      rope: True (built-in `apply_rope` with ``rope_theta``), False/None (no
        RoPE), or a callable ``(x [T, H, D], positions int32[T]) -> [T, H, D]``
        applied to Q and K.
      sliding_window: None or W (static); logits_soft_cap: None or cap > 0 (static);
      use_sinks: learn one sink logit per query head (float32 ``[Hq]``, init 0).
      scale: logit scale (static), default ``1/sqrt(D)``.
      dtype: dtype of Q/K/V and the attention (e.g. bfloat16); param_dtype: weights.
      rotation, codebook: passed to the owned cache (mse presets).
      path: attention path override (``"auto"``, ``"decode"``, ``"extend"``).

    Call: ``layer(x [T, E], meta: StepMetadata, *, cache=None) -> [T, E]`` in ``dtype``;
    rows past ``meta.query_start_loc[-1]`` (bucket padding) come out as the
    output projection of zeros (their slots are -1, nothing is written).
    """

    def __init__(self, *, embed_dim: int, num_q_heads: int, num_kv_heads: int, head_dim: int, rngs: nnx.Rngs,
                 preset="turboquant_4bit_nc", num_blocks: int | None = None, block_size: int | None = None,
                 kv_source=None, rope: bool | Callable = True, rope_theta: float = 10000.0,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None, use_sinks: bool = False,
                 scale: float | None = None, dtype=jnp.bfloat16, param_dtype=jnp.float32, rotation=None,
                 codebook=None, path: str = "auto"):
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads: expected a multiple of num_kv_heads={num_kv_heads}, got {num_q_heads}")
        if rope is not None and rope is not False and rope is not True and not callable(rope):
            raise TypeError(f"rope: expected a bool or a callable (x, positions) -> x, got {rope!r}")
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.sliding_window, self.logits_soft_cap, self.scale, self.path = sliding_window, logits_soft_cap, scale, path
        self.rope, self.rope_theta, self.dtype = rope, rope_theta, dtype
        lin = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = nnx.Linear(embed_dim, num_q_heads * head_dim, **lin)
        self.o_proj = nnx.Linear(num_q_heads * head_dim, embed_dim, **lin)
        self.kv_source = kv_source
        if kv_source is None:
            self.k_proj = nnx.Linear(embed_dim, num_kv_heads * head_dim, **lin)
            self.v_proj = nnx.Linear(embed_dim, num_kv_heads * head_dim, **lin)
        self.sinks = nnx.Param(jnp.zeros((num_q_heads,), jnp.float32)) if use_sinks else None
        if (num_blocks is None) != (block_size is None):
            raise ValueError("num_blocks, block_size: give both (the layer owns its cache) or neither")
        owns = num_blocks is not None and kv_source is None
        self.cache = nnx.data(init_cache(num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                                         head_dim=head_dim, preset=preset, rotation=rotation, codebook=codebook)
                              if owns else None)

    def _rope(self, x, positions):
        if self.rope is True:
            return apply_rope(x, positions, theta=self.rope_theta)
        if callable(self.rope):
            return self.rope(x, positions)
        return x

    def _cache(self, cache):
        if cache is not None:
            return cache
        src = self.kv_source
        if src is not None:
            return src.cache if isinstance(src, Attention) else src
        if self.cache is None:
            raise ValueError("cache: this layer owns no cache (no num_blocks/block_size); pass cache=")
        return self.cache

    def __call__(self, x, meta, *, cache=None):
        t = x.shape[0]
        cache = self._cache(cache)
        q = self._rope(self.q_proj(x).reshape(t, self.num_q_heads, self.head_dim), meta.positions)
        if self.kv_source is None:
            k = self._rope(self.k_proj(x).reshape(t, self.num_kv_heads, self.head_dim), meta.positions)
            v = self.v_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
            cache.store(k, v.astype(k.dtype), meta.slot_mapping)
        out = cache.attend(q, meta.block_table, meta.seq_lens, meta.query_start_loc, scale=self.scale,
                           sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap,
                           sinks=None if self.sinks is None else self.sinks[...], path=self.path)
        return self.o_proj(out.reshape(t, self.num_q_heads * self.head_dim))


class PagedAttention(nnx.Module):
    """Low-level store-then-attend for one layer: ``out = attend(query | cache + new K/V)``.

    Takes the op arrays one by one; model code should prefer `Attention`,
    which takes the `tq_jax.paging.StepMetadata` pytree and owns its cache.

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


def scan_layers(layers: nnx.Module, carry, fn: Callable):
    """Runs ``carry = fn(layer_i, carry)`` for the layers of a stacked module, as one `lax.scan`.

    ``layers`` holds L identical layers stacked on axis 0 of every array
    (e.g. ``nnx.vmap(lambda r: Attention(..., rngs=r))`` under
    ``nnx.split_rngs(splits=L)``; static settings such as preset and window
    are shared, so mixed stacks scan per group of identical layers). The
    layers' `nnx.Cache` arrays (``[L, N, P, Hkv, slot_bytes]``) travel in the
    scan *carry* and are read and written with dynamic slices, and the other
    state (weights) is scanned over. Scanning the caches as ``xs``/``ys``
    (what ``nnx.scan(in_axes=0)`` over the whole module does) makes XLA build
    a second stacked buffer plus a full copy of it per call; with the carry,
    the CPU HLO of a donated step has no copy of the stack, only one of a
    single layer's slice, which the kernels consume because they take one
    layer's cache (a layer index into a stacked cache would need kernel
    support). Layers run in order ``0 .. L-1``; cache updates (``store``)
    inside ``fn`` are written back into ``layers``.

    Args:
      layers: the stacked module; carry: any pytree (e.g. the hidden state ``[T, E]``);
      fn: ``(layer, carry) -> carry`` with the carry's structure, shapes and dtypes.

    Returns:
      The final carry.
    """
    graphdef, caches, rest = nnx.split(layers, nnx.Cache, ...)

    def body(c, rest_i):
        carry, caches, i = c
        cache_i = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), caches)
        layer = nnx.merge(graphdef, cache_i, rest_i)
        carry = fn(layer, carry)
        _, new_i, _ = nnx.split(layer, nnx.Cache, ...)
        caches = jax.tree.map(lambda a, n: lax.dynamic_update_index_in_dim(a, n, i, 0), caches, new_i)
        return (carry, caches, i + 1), None

    (carry, caches, _), _ = lax.scan(body, (carry, caches, jnp.int32(0)), rest)
    nnx.update(layers, caches)
    return carry
