"""`store_kv`: quantize K/V and scatter them into the paged cache (one Pallas kernel).

Grid ``(T, Hkv)``: one program per (token, kv head) writes exactly one slot,
so there is one writer per slot and no atomics. Tokens with
``slot_mapping == -1`` skip all work under `pl.when` (no masked stores whose
lanes would compute addresses from -1). The cache is aliased input -> output
(`input_output_aliases`): under ``jax.jit(..., donate_argnums=...)``, or
eagerly with ``store_kv(..., donate_cache=True)``, the update happens in
place; without donation XLA copies the cache first.

Math (DESIGN.md section 2), all in IEEE float32:

* mse keys: ``n = ||k||``, ``u = k / (n + 1e-8)``, ``y = Pi @ u`` (row chunks
  of Pi times u, summed in float32 -- never a TF32 dot), ``code = #{m_j <= y}``;
  store codes and ``fp16(n)``.
* fp8 keys: exact integer round-to-nearest-even encode after clamping to +-448.
* uniform values: ``lo, hi = min, max``; ``scale = max((hi-lo)/(2**b-1), 1e-8)``;
  ``code = clip(floor((v-lo)/scale + 0.5), 0, 2**b-1)``; store fp16 scale, fp16 lo.
* raw presets: round to bf16/fp16 and copy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

import tq_spec

from . import kernel_math as km
from .cache_access import CacheWords, WordFields, from_word_view, needs_word_view, to_word_view
from .inputs import array, index_array, not_differentiable, validate_values
from .params import resolve
from .platform import by_lowering_platform, check_interpret, interpret_default, pallas_kwargs

NORM_EPS = 1e-8
VALUE_SCALE_MIN = 1e-8
# Elements of Pi handled per rotation step (rows x D): bounds register use.
_ROTATION_TILE_ELEMENTS = 4096


def store_kv(key, value, kv_cache, slot_mapping, *, preset, rotation=None, codebook=None, interpret=None,
             donate_cache=False, validate=None):
    """Quantizes ``key``/``value`` and writes them into the slots named by `slot_mapping`.

    Args:
      key, value: ``[T, Hkv, D]`` float16/bfloat16/float32 (same dtype).
      kv_cache: ``uint8[N, P, Hkv, slot_bytes]`` (vLLM layout; see `tq_spec.layout`).
      slot_mapping: ``int32/int64[T]``; token ``t`` goes to block ``s // P``,
        offset ``s % P`` with ``s = slot_mapping[t]``; ``-1`` skips the token.
        Entries must be unique. A slot outside ``[0, N * P)`` is not written
        (guarded on device). numpy int64 is converted to int32 on the host
        (ValueError if a value does not fit).
      preset: a preset name or `tq_spec.Preset` (static).
      rotation: mse presets only: None (tq_spec's Hadamard) or ``float[D, D]``.
      codebook: mse presets only: None (flavor "vllm") or a `tq_spec.Codebook`.
      interpret: None (automatic: the Triton lowering when compiled for
        cuda/rocm, Pallas interpret mode for any other platform, decided at
        lowering time, so `jax.export` for CUDA works from a CPU host), or
        True/False to force it (static).
      donate_cache: donate `kv_cache` to an eager call, so the cache is updated
        in place instead of copied (the whole cache is copied per call
        otherwise). The input array is then *consumed*: it is deleted (reading
        it raises) and only the returned cache is valid. Under an outer
        `jax.jit` it has no effect: donate at that jit (``donate_argnums``).
      validate: full validation of `slot_mapping`'s values (in ``[-1, N * P)``,
        no duplicates), with the reference's ValueError; reads values on the
        host (a sync), so off by default; None means ``TQ_VALIDATE=1``.

    Returns:
      The new cache (same shape/dtype). Every byte outside the named slots is
      unchanged.

    Raises:
      TypeError/ValueError naming the argument for malformed input (torch
      tensors included); NotImplementedError under `jax.grad`/`jax.jvp`.

    Static (trigger recompilation): preset, interpret, donate_cache, shapes and
    dtypes; the arrays, rotation and codebook values are dynamic.
    """
    key, value, kv_cache = (array(n, x) for n, x in (("key", key), ("value", value), ("kv_cache", kv_cache)))
    slot_mapping = index_array("slot_mapping", slot_mapping)
    lay = tq_spec.validation.check_store_kv(key, value, kv_cache, slot_mapping, preset=preset)
    check_interpret(interpret)
    if tq_spec.validation.validate_enabled(validate):
        validate_values(tq_spec.validation.check_store_kv_values, dict(slot_mapping=slot_mapping),
                        key=key, value=value, kv_cache=kv_cache, preset=preset)
    kp = resolve(preset, lay.head_dim, rotation, codebook)
    fn = _store_kv_donated if donate_cache else _store_kv
    return fn(key, value, kv_cache, slot_mapping, kp.rotation, kp.midpoints, preset_name=lay.preset.name,
              interpret=interpret)


def _store_kv_impl(key, value, kv_cache, slot_mapping, rotation, midpoints, *, preset_name, interpret):
    n, p = kv_cache.shape[:2]
    # Memory safety whatever the values: a slot outside the cache is skipped
    # (compared before narrowing, so an int64 slot cannot wrap into range).
    slots = jnp.where((slot_mapping >= 0) & (slot_mapping <= min(n * p - 1, 2**31 - 1)), slot_mapping, -1)
    slots = slots.astype(jnp.int32)

    def call(key, value, kv_cache, slots, rotation, midpoints):
        return by_lowering_platform(
            functools.partial(store_kv_call, preset_name=preset_name), key, value, kv_cache, slots, rotation,
            midpoints, interpret=interpret)

    return not_differentiable("tq_jax.store_kv", call)(key, value, kv_cache, slots, rotation, midpoints)


_STORE_STATIC = ("preset_name", "interpret")
_store_kv = jax.jit(_store_kv_impl, static_argnames=_STORE_STATIC)
# The cache buffer is reused for the output (the kernel aliases it).
_store_kv_donated = jax.jit(_store_kv_impl, static_argnames=_STORE_STATIC, donate_argnums=(2,))


def store_kv_call(key, value, kv_cache, slot_mapping, rotation, midpoints, *, preset_name: str,
                  interpret: bool | None, word_view: bool | None = None):
    """The bare `pallas_call` (no validation, no slot guard); traced inside `_store_kv`.

    `interpret` None falls back to `interpret_default()` (direct calls in
    tests); `word_view` None picks the cache view from its size
    (`needs_word_view`); tests force True/False to run both kernel variants
    on small caches.
    """
    t, hkv, d = key.shape
    if t == 0:
        return kv_cache
    if interpret is None:
        interpret = interpret_default()
    lay = tq_spec.layout(preset_name, d)
    p = lay.preset
    if word_view is None:
        word_view = needs_word_view(kv_cache.shape)
    cache_in = to_word_view(kv_cache) if word_view else kv_cache
    operands = [key, value, slot_mapping]
    if p.key_format == "mse":
        operands += [rotation, midpoints]
    operands.append(cache_in)
    kernel = functools.partial(
        _store_kernel, lay=lay, fields=WordFields.of(lay), access=CacheWords(word_view),
        block_size=kv_cache.shape[1], has_tables=p.key_format == "mse", ptx_div=not interpret,
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(cache_in.shape, cache_in.dtype),
        grid=(t, hkv),
        input_output_aliases={len(operands) - 1: 0},
        name=f"tq_store_kv_{preset_name}",
        **pallas_kwargs(interpret=interpret, num_warps=4),
    )(*operands)
    return from_word_view(out) if word_view else out


def _store_kernel(*refs, lay, fields: WordFields, access: CacheWords, block_size: int, has_tables: bool,
                  ptx_div: bool):
    if has_tables:
        key_ref, value_ref, sm_ref, rot_ref, mid_ref, _cache_in, cache_ref = refs
    else:
        key_ref, value_ref, sm_ref, _cache_in, cache_ref = refs
        rot_ref = mid_ref = None
    t = pl.program_id(0)
    h = pl.program_id(1)
    slot = sm_ref[t]

    @pl.when(slot >= 0)
    def _write():
        blk = slot // block_size
        off = slot % block_size
        dst = functools.partial(access.store, cache_ref, blk, off, h)
        p = lay.preset
        if p.key_format == "raw":
            _write_raw(dst, key_ref, t, h, lay.head_dim, fields.key, p.raw_dtype)
            _write_raw(dst, value_ref, t, h, lay.head_dim, fields.value, p.raw_dtype)
            return
        if p.key_format == "fp8":
            _write_fp8_key(dst, key_ref, t, h, lay.head_dim, fields.key)
        else:
            _write_mse_key(dst, key_ref, rot_ref, mid_ref, t, h, lay.head_dim, p.key_bits, fields, ptx_div)
        _write_uniform_value(dst, value_ref, t, h, lay.head_dim, p.value_bits, fields, ptx_div)


def _lanes(d: int):
    """Lane indices padded to a power of two, their in-range copy and validity."""
    dp = km.next_pow2(d)
    lane = lax.broadcasted_iota(jnp.int32, (dp,), 0)
    return dp, lane, jnp.minimum(lane, d - 1), lane < d


def _write_raw(dst, src_ref, t, h, d, word0, dtype_name):
    dp, lane, lane_c, ok = _lanes(d)
    x = src_ref[t, h, lane_c].astype(jnp.float32)
    dst(word0 + lane, km.f32_to_half_bits(x, dtype_name), None if dp == d else ok)


def _write_fp8_key(dst, key_ref, t, h, d, word0):
    # Word w holds elements 2w (low byte) and 2w + 1 (high byte).
    n_words = d // 2
    wp = km.next_pow2(n_words)
    w = lax.broadcasted_iota(jnp.int32, (wp,), 0)
    even = key_ref[t, h, jnp.minimum(2 * w, d - 1)].astype(jnp.float32)
    odd = key_ref[t, h, jnp.minimum(2 * w + 1, d - 1)].astype(jnp.float32)
    word = km.fp8_e4m3fn_encode(even) | (km.fp8_e4m3fn_encode(odd) << 8)
    dst(word0 + w, word, None if wp == n_words else w < n_words)


def _write_mse_key(dst, key_ref, rot_ref, mid_ref, t, h, d, bits, fields: WordFields, ptx_div: bool):
    k = key_ref[t, h, :].astype(jnp.float32)  # D is a power of two for mse presets
    norm = jnp.sqrt(jnp.sum(k * k))
    unit = km.ieee_div(k, norm + NORM_EPS, use_ptx=ptx_div)
    rows = min(d, max(16, _ROTATION_TILE_ELEMENTS // d))
    groups = rows // 16
    g = lax.broadcasted_iota(jnp.int32, (groups,), 0)

    def rotate_rows(i, carry):
        r0 = pl.multiple_of(i * rows, rows)
        pi = rot_ref[pl.ds(r0, rows), :]
        y = jnp.sum(pi * unit[None, :], axis=1)  # explicit fp32 products and sums: IEEE, no TF32
        mids = mid_ref[...]
        codes = jnp.sum((y[:, None] >= mids[None, :]).astype(jnp.int32), axis=1)
        base = fields.key + (r0 // 16) * bits
        for j, word in enumerate(km.pack_code_groups(codes, bits)):
            dst(base + g * bits + j, word)
        return carry

    lax.fori_loop(0, d // rows, rotate_rows, 0)
    dst(fields.key_norm, km.f32_to_half_bits(norm))


def _write_uniform_value(dst, value_ref, t, h, d, bits, fields: WordFields, ptx_div: bool):
    dp, lane, lane_c, ok = _lanes(d)
    v = value_ref[t, h, lane_c].astype(jnp.float32)
    lo = jnp.min(jnp.where(ok, v, jnp.inf))
    hi = jnp.max(jnp.where(ok, v, -jnp.inf))
    levels = (1 << bits) - 1
    scale = jnp.maximum(km.ieee_div(hi - lo, float(levels), use_ptx=ptx_div), VALUE_SCALE_MIN)
    position = km.ieee_div(v - lo, scale, use_ptx=ptx_div) + 0.5
    codes = jnp.clip(jnp.floor(position), 0.0, float(levels)).astype(jnp.int32)
    codes = jnp.where(ok, codes, 0)
    g = lax.broadcasted_iota(jnp.int32, (dp // 16,), 0)
    for j, word in enumerate(km.pack_code_groups(codes, bits)):
        index = g * bits + j
        # D * bits is a multiple of 16 at every supported head dim, so a word
        # is either wholly inside the stream or wholly past it.
        mask = None if dp == d else (16 * index < d * bits)
        dst(fields.value + index, word, mask)
    dst(fields.value_scale, km.f32_to_half_bits(scale))
    dst(fields.value_zero, km.f32_to_half_bits(lo))
