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
  `nnx.vmap`) that carries the stacked caches and hands each layer the whole
  stack seen as one bigger cache (page ids offset by ``layer * N``), so no
  layer's cache is sliced out or copied (see there).
* Multi-device: ``mesh=``/``kv_axis=`` on `Attention` / `init_cache` split the
  cache and the heads along kv heads over a mesh axis (`tq_jax.sharding`);
  results are bit for bit the single-device ones.
* `PagedAttention`: the low-level store-then-attend over explicit arrays
  (kept for existing code; `Attention` is the model-level module).

Under `nnx.jit(..., donate_argnums=...)` donating the module (or its state)
lets XLA update each cache buffer in place: the step rewrites only the slots
named by ``slot_mapping`` and the buffer keeps its address (tested on CPU, and
on the GPU by ``pytest -m gpu``; with a mesh, every device's shard keeps its
address).
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

from . import sharding as _sharding
from ._src.attention import paged_attention
from ._src.store import store_kv

__all__ = [
    "Attention", "DenseKVCache", "KVPages", "PagedAttention", "PagedKVCache", "apply_rope", "cache_bytes_per_token",
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


class KVPages(nnx.Cache):
    """The `nnx.Cache` variable type of a layer's page buffer (filters on `nnx.Cache` include it).

    `scan_layers` recognises these buffers by type: they are the ones it may
    view as one bigger cache across the stacked layers.
    """


def _place(x, mesh, kv_axis):
    """``x`` laid out along kv heads (dim 2) over ``mesh[kv_axis]``; unchanged without a mesh."""
    if mesh is None:
        return x
    return jax.device_put(x, _sharding.cache_sharding(mesh, kv_axis, ndim=x.ndim))


class _StackedView:
    """Page-id arithmetic while `scan_layers` hands a layer the whole stack.

    A stack of L caches ``[L, N, P, ...]`` is contiguous, so ``[L * N, P, ...]``
    is the same buffer (a bitcast) and layer ``i`` owns its pages
    ``i * N .. i * N + N - 1``. The kernels then read and write the stack in
    place with shifted page ids and slots, and no layer's cache is sliced out.
    Ids that are invalid for one layer map to ids invalid for the stack
    (negative ids stay, ids >= N go past the end), so the ops' guards and
    ``validate=`` treat them as they would for the layer alone.
    """

    @staticmethod
    def offset(cache_module):
        return cache_module.__dict__.get("_stack_layer")

    @staticmethod
    def slots(slot_mapping, layer, per_layer: int, total: int):
        sm = jnp.asarray(slot_mapping).astype(jnp.int32)
        return jnp.where(sm < 0, sm, jnp.where(sm < per_layer, sm + layer * per_layer, total))

    @staticmethod
    def pages(block_table, layer, per_layer: int, total: int):
        bt = jnp.asarray(block_table).astype(jnp.int32)
        return jnp.where(bt < 0, bt, jnp.where(bt < per_layer, bt + layer * per_layer, total))


class PagedKVCache(nnx.Module):
    """The paged cache of one attention layer.

    Args:
      num_blocks, block_size, num_kv_heads: cache geometry ``[N, P, Hkv, ...]``.
      head_dim: D (must suit the preset, see `tq_spec.layout`).
      preset: preset name or `tq_spec.Preset`.
      rotation: mse presets only: None (tq_spec's Hadamard) or float ``[D, D]``
        (e.g. ``tq_spec.rotation(D, "randomized_hadamard", seed=...)``).
      codebook: mse presets only: None or a `tq_spec.Codebook`.
      mesh, kv_axis: optional `jax.sharding.Mesh` and axis name (or tuple of
        names): the cache is laid out split along kv heads over that axis
        (``Hkv`` divisible by its devices) and ``store``/``attend`` run under
        `shard_map` (`tq_jax.sharding`), bit for bit the single-device result.

    Attributes:
      kv_cache: `KVPages` (an `nnx.Cache`) of ``uint8[N, P, Hkv, slot_bytes]`` (zeros initially).
    """

    def __init__(self, *, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, preset,
                 rotation=None, codebook=None, mesh=None, kv_axis="kv"):
        lay = tq_spec.layout(preset, head_dim)
        tq_spec.quant_params(lay.preset, head_dim, rotation=rotation, codebook=codebook)  # validate early
        if mesh is not None and num_kv_heads % _sharding.num_shards(mesh, kv_axis):
            raise ValueError(f"num_kv_heads: expected a multiple of the {_sharding.num_shards(mesh, kv_axis)} "
                             f"devices of mesh axis {kv_axis!r}, got {num_kv_heads}")
        self.preset = lay.preset.name
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.codebook = codebook
        self.mesh, self.kv_axis = mesh, kv_axis
        self.rotation = None if rotation is None else nnx.Variable(jnp.asarray(rotation, jnp.float32))
        self.kv_cache = KVPages(_place(jnp.zeros((num_blocks, block_size, num_kv_heads, lay.slot_bytes), jnp.uint8),
                                       mesh, kv_axis))

    @property
    def nbytes(self) -> int:
        """Bytes of the cache buffer."""
        return int(self.kv_cache[...].size)

    def _rotation(self):
        return None if self.rotation is None else self.rotation[...]

    def store(self, key, value, slot_mapping) -> None:
        """Quantizes ``key/value [T, Hkv, D]`` into the slots of ``slot_mapping int32[T]`` (-1 skips)."""
        c = self.kv_cache[...]
        layer = _StackedView.offset(self)
        if layer is not None:
            per = self.num_blocks * self.block_size
            slot_mapping = _StackedView.slots(slot_mapping, layer, per, c.shape[0] * self.block_size)
        kw = dict(preset=self.preset, rotation=self._rotation(), codebook=self.codebook)
        if self.mesh is None:
            self.kv_cache[...] = store_kv(key, value, c, slot_mapping, **kw)
        else:
            self.kv_cache[...] = _sharding.store_kv(key, value, c, slot_mapping, mesh=self.mesh, axis=self.kv_axis,
                                                    **kw)

    def attend(self, query, block_table, seq_lens, query_start_loc, *, scale=None, sliding_window=None,
               logits_soft_cap=None, sinks=None, path="auto"):
        """`tq_jax.paged_attention` over this cache; returns ``[T, Hq, D]`` in the query dtype."""
        c = self.kv_cache[...]
        layer = _StackedView.offset(self)
        if layer is not None:
            block_table = _StackedView.pages(block_table, layer, self.num_blocks, c.shape[0])
        kw = dict(preset=self.preset, scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                  sinks=sinks, rotation=self._rotation(), codebook=self.codebook, path=path)
        if self.mesh is None:
            return paged_attention(query, c, block_table, seq_lens, query_start_loc, **kw)
        return _sharding.paged_attention(query, c, block_table, seq_lens, query_start_loc, mesh=self.mesh,
                                         axis=self.kv_axis, **kw)


def init_cache(*, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, preset="turboquant_4bit_nc",
               rotation=None, codebook=None, mesh=None, kv_axis="kv") -> PagedKVCache:
    """A zeroed `PagedKVCache` (``uint8[N, P, Hkv, slot_bytes]``); ``preset="dense"`` gives a `DenseKVCache`.

    With ``mesh`` (and ``kv_axis``, default ``"kv"``) the cache is split along kv heads over that mesh axis
    and its ops run per device under `shard_map` (see `tq_jax.sharding`).
    """
    if preset == "dense":
        return DenseKVCache(num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, mesh=mesh, kv_axis=kv_axis)
    return PagedKVCache(num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                        preset=preset, rotation=rotation, codebook=codebook, mesh=mesh, kv_axis=kv_axis)


class DenseKVCache(nnx.Module):
    """Unquantized paged K/V in plain jnp, with `PagedKVCache`'s ``store``/``attend`` interface.

    A quality reference (the "dense" model of the example): K and V are kept
    as ``dtype`` values (``[N, P, Hkv, 2, D]``, a `KVPages` holding their bit
    patterns as same-width unsigned ints: XLA:CPU turns a bf16/fp16 scatter
    into a float32 one over a converted copy of the whole buffer, an integer
    scatter updates it in place) and attention is a
    masked softmax over each sequence's gathered pages in float32, with the
    same semantics (causal, window, soft cap, sinks, padding rows zero).
    Memory and time grow with ``B * max_blocks * P``; not a serving path.
    With ``mesh`` the buffer is laid out along kv heads and XLA partitions the
    plain jnp ops.
    """

    preset = "dense"

    def __init__(self, *, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.bfloat16,
                 mesh=None, kv_axis="kv"):
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = jnp.dtype(dtype)
        bits = jnp.dtype(f"uint{8 * self.dtype.itemsize}")
        self.kv_cache = KVPages(_place(jnp.zeros((num_blocks, block_size, num_kv_heads, 2, head_dim), bits),
                                       mesh, kv_axis))

    @property
    def nbytes(self) -> int:
        c = self.kv_cache[...]
        return int(c.size * c.dtype.itemsize)

    def store(self, key, value, slot_mapping) -> None:
        c = self.kv_cache[...]
        n, p = c.shape[:2]
        layer = _StackedView.offset(self)
        if layer is not None:
            slot_mapping = _StackedView.slots(slot_mapping, layer, self.num_blocks * p, n * p)
        flat = c.reshape((n * p,) + c.shape[2:])
        slots = jnp.where(slot_mapping < 0, n * p, slot_mapping)  # out of bounds: dropped
        kv = lax.bitcast_convert_type(jnp.stack([key, value], axis=2).astype(self.dtype), c.dtype)
        self.kv_cache[...] = flat.at[slots].set(kv, mode="drop").reshape(c.shape)

    def attend(self, query, block_table, seq_lens, query_start_loc, *, scale=None, sliding_window=None,
               logits_soft_cap=None, sinks=None, path="auto"):
        del path
        c = self.kv_cache[...]
        layer = _StackedView.offset(self)
        if layer is not None:
            block_table = _StackedView.pages(block_table, layer, self.num_blocks, c.shape[0])
        t, hq, d = query.shape
        b_count, max_blocks = block_table.shape
        p, hkv = c.shape[1], c.shape[2]
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        rows = jnp.arange(t, dtype=jnp.int32)
        b = jnp.clip(jnp.searchsorted(query_start_loc, rows, side="right").astype(jnp.int32) - 1, 0, b_count - 1)
        real = (rows >= query_start_loc[0]) & (rows < query_start_loc[-1])
        q_len = query_start_loc[b + 1] - query_start_loc[b]
        pos = seq_lens[b] - q_len + (rows - query_start_loc[b])
        kv = lax.bitcast_convert_type(c[block_table], self.dtype)
        kv = kv.reshape(b_count, max_blocks * p, hkv, 2, d).astype(jnp.float32)
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
      mesh, kv_axis: split the owned cache and the attention along kv heads over
        ``mesh[kv_axis]`` (``Hkv`` divisible by its devices; see `init_cache` and
        `tq_jax.sharding`); the projections stay as they are (shard their
        weights as you like, XLA moves the heads to their devices).

    Call: ``layer(x [T, E], meta: StepMetadata, *, cache=None) -> [T, E]`` in ``dtype``;
    rows past ``meta.query_start_loc[-1]`` (bucket padding) come out as the
    output projection of zeros (their slots are -1, nothing is written).
    """

    def __init__(self, *, embed_dim: int, num_q_heads: int, num_kv_heads: int, head_dim: int, rngs: nnx.Rngs,
                 preset="turboquant_4bit_nc", num_blocks: int | None = None, block_size: int | None = None,
                 kv_source=None, rope: bool | Callable = True, rope_theta: float = 10000.0,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None, use_sinks: bool = False,
                 scale: float | None = None, dtype=jnp.bfloat16, param_dtype=jnp.float32, rotation=None,
                 codebook=None, path: str = "auto", mesh=None, kv_axis="kv"):
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
                                         head_dim=head_dim, preset=preset, rotation=rotation, codebook=codebook,
                                         mesh=mesh, kv_axis=kv_axis)
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
    are shared, so mixed stacks scan per group of identical layers). Layers
    run in order ``0 .. L-1``; cache updates inside ``fn`` are written back
    into ``layers``.

    No layer's cache is copied. The stacked page buffers (`KVPages`,
    ``[L, N, P, Hkv, slot_bytes]``) travel in the scan *carry*, seen as one
    cache of ``L * N`` pages (a free reshape of the contiguous stack); layer
    ``i``'s `PagedKVCache` / `DenseKVCache` reads and writes that whole buffer
    with its page ids and slots shifted by ``i * N`` (invalid ids stay
    invalid), so the kernels update the stack in place. Measured in the
    compiled CPU HLO of a donated decode step (``tests/jax/test_jax_nnx_model.py``):
    no copy, dynamic-slice or dynamic-update-slice of a cache-sized buffer, and
    temporaries smaller than one layer's cache. The alternatives cost a full
    cache copy per layer and step: slicing layer ``i`` out of the carry (and
    writing it back) copies one layer's cache; scanning the caches as
    ``xs``/``ys`` (``nnx.scan(in_axes=0)`` over the whole module) builds a
    second stacked buffer plus a copy of it. Other `nnx.Cache` variables of
    the layers (not `KVPages`) are sliced per layer and written back.

    Args:
      layers: the stacked module; carry: any pytree (e.g. the hidden state ``[T, E]``);
      fn: ``(layer, carry) -> carry`` with the carry's structure, shapes and dtypes.

    Returns:
      The final carry.
    """
    graphdef, pages, other, rest = nnx.split(layers, KVPages, nnx.Cache, ...)
    # [L, N, ...] -> [L * N, ...]: a bitcast of the contiguous stack.
    flat = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), pages)

    def body(c, rest_i):
        carry, flat, other, i = c
        other_i = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), other)
        layer = nnx.merge(graphdef, flat, other_i, rest_i)
        caches = [node for _, node in nnx.iter_graph(layer) if isinstance(node, (PagedKVCache, DenseKVCache))]
        for cache in caches:  # read by _StackedView.offset; never part of the graph
            object.__setattr__(cache, "_stack_layer", i)
        try:
            carry = fn(layer, carry)
        finally:
            for cache in caches:
                object.__delattr__(cache, "_stack_layer")
        _, flat, new_other, _ = nnx.split(layer, KVPages, nnx.Cache, ...)
        other = jax.tree.map(lambda a, n: lax.dynamic_update_index_in_dim(a, n, i, 0), other, new_other)
        return (carry, flat, other, i + 1), None

    (carry, flat, other, _), _ = lax.scan(body, (carry, flat, other, jnp.int32(0)), rest)
    nnx.update(layers, jax.tree.map(lambda f, a: f.reshape(a.shape), flat, pages), other)
    return carry
