"""Plain-torch decode of a whole cache (for tests, debugging and symmetry with tq_spec)."""

from __future__ import annotations

import torch

import tq_spec

from . import params


def _unpack(field: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """LSB-first ``bits``-bit codes ``[..., n]`` (int64) from bytes ``field [..., nbytes]``."""
    bit = torch.arange(n, device=field.device) * bits
    byte, shift = bit // 8, bit % 8
    padded = torch.nn.functional.pad(field.to(torch.int64), (0, 1))  # a code may straddle 2 bytes
    word = padded[..., byte] | (padded[..., byte + 1] << 8)
    return (word >> shift) & ((1 << bits) - 1)


def _fp16_field(cache: torch.Tensor, offset: int) -> torch.Tensor:
    return cache[..., offset:offset + 2].contiguous().view(torch.float16)[..., 0].to(torch.float32)


def dequantize_cache(kv_cache: torch.Tensor, *, preset, head_dim: int, rotation=None, codebook=None):
    """Decodes ``uint8[N, P, Hkv, S]`` into ``(K, V)`` float32 ``[N, P, Hkv, D]`` in model space.

    mse keys are un-rotated (``k = Pi^T (n * c_hat)``), matching
    `tq_spec.reference.dequantize_cache` up to float32 rounding. Garbage slots
    decode to whatever their bytes say (possibly NaN/Inf).
    """
    p = tq_spec.get_preset(preset)
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv_cache: expected a torch.Tensor, got {type(kv_cache).__name__}")
    lay = tq_spec.layout(p, head_dim)
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4 or kv_cache.shape[-1] != lay.slot_bytes:
        raise ValueError(
            f"kv_cache: expected uint8[N, P, Hkv, {lay.slot_bytes}], got {kv_cache.dtype}{list(kv_cache.shape)}")
    d = head_dim
    dev = kv_cache.device
    if p.key_format == "raw":
        dt = torch.bfloat16 if p.raw_dtype == "bfloat16" else torch.float16
        k = kv_cache[..., :2 * d].contiguous().view(dt).to(torch.float32)
        v = kv_cache[..., lay.value_offset:lay.value_offset + 2 * d].contiguous().view(dt).to(torch.float32)
        return k, v
    if p.key_format == "fp8":
        k = kv_cache[..., :d].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    else:
        user = params.resolve_user_params(p, d, dev, rotation, codebook)
        rot = user.rotation if user.rotation is not None else params.default_rotation(p.name, d, dev)
        cents = user.centroids if user.centroids is not None else params.default_centroids(p.name, d, dev)
        c = cents[_unpack(kv_cache[..., :lay.key_bytes], p.key_bits, d)]
        if p.norm_correction:
            c = c / torch.linalg.vector_norm(c, dim=-1, keepdim=True)
        k = (_fp16_field(kv_cache, lay.key_norm_offset)[..., None] * c) @ rot
    codes = _unpack(kv_cache[..., lay.value_offset:lay.value_offset + lay.value_bytes], p.value_bits, d)
    scale = _fp16_field(kv_cache, lay.value_scale_offset)
    zero = _fp16_field(kv_cache, lay.value_zero_offset)
    v = codes.to(torch.float32) * scale[..., None] + zero[..., None]
    return k, v
