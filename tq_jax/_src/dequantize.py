"""`dequantize_cache`: the whole cache back to float K/V, in plain jnp (no kernel).

Meant for debugging, tests and model-side tooling, not for the attention hot
path (which dequantizes tiles inside the kernels). Same decode rules as
`tq_spec.reference.dequantize_cache`, in float32 instead of float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import tq_spec

from . import kernel_math as km
from .params import resolve


def dequantize_cache(kv_cache, *, preset, head_dim, rotation=None, codebook=None):
    """Decodes ``uint8[N, P, Hkv, slot_bytes]`` into ``(K, V)`` float32 ``[N, P, Hkv, D]``.

    Keys are returned in model space (mse presets: ``k = Pi^T (n * c_hat)``).
    Garbage slots decode to whatever their bytes say (possibly NaN).
    `preset` and `head_dim` are static.
    """
    lay = tq_spec.layout(preset, head_dim)
    if str(kv_cache.dtype) != "uint8" or kv_cache.ndim != 4 or kv_cache.shape[-1] != lay.slot_bytes:
        raise ValueError(
            f"kv_cache: expected uint8[N, P, Hkv, {lay.slot_bytes}] for preset {lay.preset.name!r} at "
            f"head_dim {head_dim}, got {kv_cache.dtype}{list(kv_cache.shape)}"
        )
    kp = resolve(lay.preset, head_dim, rotation, codebook)
    return _dequantize_jit(jnp.asarray(kv_cache), kp.rotation, kp.centroids, preset_name=lay.preset.name,
                       head_dim=head_dim)


def _bytes_le16(slots, offset):
    """Little-endian 16-bit fields at byte `offset` (an int or an int array of offsets)."""
    lo = jnp.take(slots, offset, axis=-1).astype(jnp.int32)
    hi = jnp.take(slots, offset + 1, axis=-1).astype(jnp.int32)
    return lo | (hi << 8)


def _unpack(slots, offset, bits, d):
    e = jnp.arange(d, dtype=jnp.int32)
    bit = e * bits
    byte = offset + bit // 8
    # Two bytes always hold a code of <= 8 bits; the second may be the next field.
    lo = jnp.take(slots, byte, axis=-1).astype(jnp.int32)
    hi = jnp.take(slots, jnp.minimum(byte + 1, slots.shape[-1] - 1), axis=-1).astype(jnp.int32)
    return ((lo | (hi << 8)) >> (bit % 8)) & ((1 << bits) - 1)


def scoring_space_kv(slots, centroids, *, preset_name: str, head_dim: int):
    """``(K, V)`` float32 ``[..., D]`` of slots ``uint8[..., slot_bytes]``, keys in scoring space.

    mse keys stay in the rotated basis (``norm * c_hat``, pairing with ``q_rot = Pi @ q``);
    `dequantize_cache` rotates them back.
    """
    lay = tq_spec.layout(preset_name, head_dim)
    p, d = lay.preset, head_dim
    if p.key_format == "raw":
        e = jnp.arange(d)
        k = km.half_bits_to_f32(_bytes_le16(slots, lay.key_offset + 2 * e), p.raw_dtype)
        v = km.half_bits_to_f32(_bytes_le16(slots, lay.value_offset + 2 * e), p.raw_dtype)
        return k, v
    if p.key_format == "fp8":
        k = km.fp8_e4m3fn_decode(slots[..., lay.key_offset: lay.key_offset + d].astype(jnp.int32))
    else:
        c = centroids[_unpack(slots, lay.key_offset, p.key_bits, d)]
        if p.norm_correction:
            c = c / jnp.sqrt(jnp.sum(c * c, axis=-1, keepdims=True))
        k = km.half_bits_to_f32(_bytes_le16(slots, lay.key_norm_offset))[..., None] * c
    scale = km.half_bits_to_f32(_bytes_le16(slots, lay.value_scale_offset))
    zero = km.half_bits_to_f32(_bytes_le16(slots, lay.value_zero_offset))
    codes = _unpack(slots, lay.value_offset, p.value_bits, d).astype(jnp.float32)
    return k, codes * scale[..., None] + zero[..., None]


def _dequantize_impl(slots, rotation, centroids, *, preset_name, head_dim):
    k, v = scoring_space_kv(slots, centroids, preset_name=preset_name, head_dim=head_dim)
    if tq_spec.get_preset(preset_name).key_format == "mse":
        k = jnp.einsum("...r,rd->...d", k, rotation, precision=lax.Precision.HIGHEST)  # back to model space
    return k, v


_dequantize_jit = jax.jit(_dequantize_impl, static_argnames=("preset_name", "head_dim"))
