"""Float64 encode/decode of whole slots (one token, one kv head per slot).

This is the oracle of DESIGN.md section 2. Encoding computes in float64 from
the input values (which are exactly representable in fp32), except where the
contract names fp32 (the value scale), so the kernels' IEEE fp32 results agree
except at bucket boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .bits import pack_bits, unpack_bits
from .floats import (
    FP8_E4M3FN_MAX,
    bf16_bytes,
    bf16_from_bytes,
    fp16_bytes,
    fp16_from_bytes,
    fp8_e4m3fn_decode,
    fp8_e4m3fn_encode,
)
from .params import QuantParams

NORM_EPS = 1e-8  # u = k / (||k|| + NORM_EPS)
VALUE_SCALE_MIN = 1e-8


@dataclass(frozen=True)
class EncodeDetails:
    """Pre-quantization quantities, for boundary-aware comparisons.

    ``key_rotated``: float64 ``[..., D]`` rotated unit key ``y`` (mse presets);
    ``value_position``: float64 ``[..., D]`` ``(v - lo) / scale + 0.5`` whose
    floor is the value code (uniform values). Either may be None.
    """

    key_rotated: np.ndarray | None
    value_position: np.ndarray | None


def _as_f64(name: str, x) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype.kind not in "fc" and str(a.dtype) not in ("bfloat16", "float8_e4m3fn"):
        raise TypeError(f"{name}: expected a float array, got dtype {a.dtype}")
    return a.astype(np.float64)


def _encode_raw(x: np.ndarray, dtype_name: str) -> np.ndarray:
    x32 = x.astype(np.float32)
    b = bf16_bytes(x32) if dtype_name == "bfloat16" else fp16_bytes(x32)
    return b.reshape(*x.shape[:-1], 2 * x.shape[-1])


def _decode_raw(b: np.ndarray, dtype_name: str, d: int) -> np.ndarray:
    pairs = b.reshape(*b.shape[:-1], d, 2)
    f = bf16_from_bytes(pairs) if dtype_name == "bfloat16" else fp16_from_bytes(pairs)
    return f.astype(np.float64)


def _encode_mse_key(k: np.ndarray, params: QuantParams):
    cb = params.codebook
    norm = np.sqrt(np.sum(k * k, axis=-1, keepdims=True))
    unit = k / (norm + NORM_EPS)
    y = unit @ params.rotation.astype(np.float64).T  # y = Pi @ u, row-vector form
    codes = np.sum(y[..., None] >= cb.midpoints.astype(np.float64), axis=-1).astype(np.uint8)
    return pack_bits(codes, params.preset.key_bits), fp16_bytes(norm[..., 0]), y


def _encode_uniform_value(v: np.ndarray, bits: int):
    levels = (1 << bits) - 1
    lo = v.min(axis=-1, keepdims=True)
    hi = v.max(axis=-1, keepdims=True)
    # The contract computes the scale in fp32: (hi - lo) rounds once to fp32,
    # then the division by the level count rounds once more.
    span32 = (hi - lo).astype(np.float32)
    scale32 = np.maximum(span32 / np.float32(levels), np.float32(VALUE_SCALE_MIN)).astype(np.float32)
    position = (v - lo) / scale32.astype(np.float64) + 0.5
    codes = np.clip(np.floor(position), 0, levels).astype(np.uint8)
    return pack_bits(codes, bits), fp16_bytes(scale32[..., 0]), fp16_bytes(lo[..., 0]), position


def encode_slots(key, value, params: QuantParams, *, details: bool = False):
    """Encodes ``key[..., D]``, ``value[..., D]`` into ``uint8[..., slot_bytes]``.

    With ``details=True`` returns ``(slots, EncodeDetails)``.
    """
    lay = params.layout
    p = lay.preset
    k = _as_f64("key", key)
    v = _as_f64("value", value)
    d = lay.head_dim
    if k.shape[-1] != d or v.shape != k.shape:
        raise ValueError(
            f"key/value: expected matching shapes [..., {d}], got {k.shape} and {v.shape}"
        )
    out = np.zeros((*k.shape[:-1], lay.slot_bytes), np.uint8)
    key_rotated = value_position = None
    if p.key_format == "raw":
        out[..., : lay.key_bytes] = _encode_raw(k, p.raw_dtype)
        out[..., lay.value_offset : lay.value_offset + lay.value_bytes] = _encode_raw(v, p.raw_dtype)
    else:
        if p.key_format == "fp8":
            out[..., : lay.key_bytes] = fp8_e4m3fn_encode(np.clip(k, -FP8_E4M3FN_MAX, FP8_E4M3FN_MAX))
        else:
            codes, norm, key_rotated = _encode_mse_key(k, params)
            out[..., : lay.key_bytes] = codes
            out[..., lay.key_norm_offset : lay.key_norm_offset + 2] = norm
        vcodes, scale, zero, value_position = _encode_uniform_value(v, p.value_bits)
        out[..., lay.value_offset : lay.value_offset + lay.value_bytes] = vcodes
        out[..., lay.value_scale_offset : lay.value_scale_offset + 2] = scale
        out[..., lay.value_zero_offset : lay.value_zero_offset + 2] = zero
    if details:
        return out, EncodeDetails(key_rotated, value_position)
    return out


def decode_slots(slots, params: QuantParams, *, dtype=np.float64):
    """Decodes ``uint8[..., slot_bytes]`` into ``(key_scoring, value)`` ``[..., D]``.

    ``key_scoring`` is the key in the space where scores are taken: for mse
    presets that is the *rotated* space (``n * c_hat[code]``; pair it with
    ``q_rot = Pi @ q``); for the other presets it is the key itself.
    ``dtype=np.float32`` does the arithmetic the way fp32 kernels do (the norm
    correction as one fp32 factor ``n / ||c||`` per token) for emulation.
    """
    # Garbage bytes (unused pages, canaries) may decode to NaN/Inf; that is
    # expected and must not warn: callers decide what they read.
    with np.errstate(invalid="ignore", over="ignore"):
        return _decode_slots(slots, params, np.dtype(dtype).type)


def _decode_slots(slots, params: QuantParams, ftype):
    lay = params.layout
    p = lay.preset
    s = np.asarray(slots)
    if s.dtype != np.uint8 or s.shape[-1] != lay.slot_bytes:
        raise ValueError(
            f"slots: expected uint8[..., {lay.slot_bytes}], got {s.dtype}{list(s.shape)}"
        )
    d = lay.head_dim
    if p.key_format == "raw":
        k = _decode_raw(s[..., : lay.key_bytes], p.raw_dtype, d)
        v = _decode_raw(s[..., lay.value_offset : lay.value_offset + lay.value_bytes], p.raw_dtype, d)
        return k.astype(ftype), v.astype(ftype)
    if p.key_format == "fp8":
        k = fp8_e4m3fn_decode(s[..., : lay.key_bytes]).astype(ftype)
    else:
        codes = unpack_bits(s[..., : lay.key_bytes], p.key_bits, d)
        c = params.codebook.centroids.astype(ftype)[codes]
        norm = fp16_from_bytes(s[..., lay.key_norm_offset : lay.key_norm_offset + 2]).astype(ftype)[..., None]
        if p.norm_correction:
            if ftype is np.float64:
                c = c / np.sqrt(np.sum(c * c, axis=-1, keepdims=True))
            else:
                norm = norm / np.sqrt(np.sum(c * c, axis=-1, keepdims=True, dtype=ftype))
        k = norm * c
    vcodes = unpack_bits(s[..., lay.value_offset : lay.value_offset + lay.value_bytes], p.value_bits, d)
    scale = fp16_from_bytes(s[..., lay.value_scale_offset : lay.value_scale_offset + 2]).astype(ftype)
    zero = fp16_from_bytes(s[..., lay.value_zero_offset : lay.value_zero_offset + 2]).astype(ftype)
    v = vcodes.astype(ftype) * scale[..., None] + zero[..., None]
    return k, v


def unrotate_keys(key_scoring: np.ndarray, params: QuantParams) -> np.ndarray:
    """Maps keys from scoring space back to the model's space (``k = Pi^T y``)."""
    if params.rotation is None:
        return key_scoring
    return key_scoring @ params.rotation.astype(np.float64)


def rotate_queries(query: np.ndarray, params: QuantParams) -> np.ndarray:
    """Maps queries into scoring space (``q_rot = Pi @ q``; identity without rotation)."""
    if params.rotation is None:
        return query
    return query @ params.rotation.astype(np.float64).T
