"""Exact numpy encoders/decoders for the small float fields of the format.

fp8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits, no infinities,
0x7F/0xFF are NaN, largest finite 448. Encoding rounds to nearest even and
saturates to +-448 (the cache format clamps before the cast, as Hopper's
saturating conversion does); NaN stays NaN. fp16 and bf16 fields are
little-endian and rounded to nearest even.
"""

from __future__ import annotations

import numpy as np

FP8_E4M3FN_MAX = 448.0
_FP8_MIN_NORMAL_EXP = -6  # smallest normal is 2**-6
_FP8_MANTISSA_BITS = 3


def fp8_e4m3fn_encode(x) -> np.ndarray:
    """Float array -> uint8 fp8 e4m3fn bit patterns (same shape)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return _fp8_encode(np.asarray(x, dtype=np.float64))


def _fp8_encode(x: np.ndarray) -> np.ndarray:
    sign = np.signbit(x).astype(np.uint8) << 7
    a = np.minimum(np.abs(np.nan_to_num(x, nan=0.0, posinf=np.inf, neginf=-np.inf)), FP8_E4M3FN_MAX)
    # Quantum of the binade (or of the subnormal range): round |x| to a
    # multiple of it, half to even. A carry into the next binade lands on the
    # next binade's first value, which the encoding below handles uniformly.
    _, e = np.frexp(a)  # a = m * 2**e with m in [0.5, 1)
    exp = np.maximum(e - 1, _FP8_MIN_NORMAL_EXP)
    quantum = np.ldexp(1.0, exp - _FP8_MANTISSA_BITS)
    q = np.rint(a / quantum) * quantum
    q = np.minimum(q, FP8_E4M3FN_MAX)
    _, qe = np.frexp(q)
    q_exp = qe - 1
    normal = q >= 2.0**_FP8_MIN_NORMAL_EXP
    sub_code = np.rint(q / 2.0 ** (_FP8_MIN_NORMAL_EXP - _FP8_MANTISSA_BITS))
    mant = np.rint(q / np.ldexp(1.0, q_exp - _FP8_MANTISSA_BITS)) - 8
    norm_code = ((q_exp + 7) << 3) + mant
    code = np.where(normal, norm_code, sub_code).astype(np.uint8)
    code = np.where(np.isnan(x), np.uint8(0x7F), code)
    return (code | sign).astype(np.uint8)


def fp8_e4m3fn_decode(codes) -> np.ndarray:
    """uint8 fp8 e4m3fn bit patterns -> float32 values (NaN for 0x7F/0xFF)."""
    c = np.asarray(codes)
    if c.dtype != np.uint8:
        raise TypeError(f"codes: expected uint8, got {c.dtype}")
    c = c.astype(np.int32)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e = (c >> 3) & 0xF
    m = c & 0x7
    val = np.where(
        e == 0,
        m * 2.0 ** (_FP8_MIN_NORMAL_EXP - _FP8_MANTISSA_BITS),
        (8 + m) * np.ldexp(1.0, e - 7 - _FP8_MANTISSA_BITS),
    )
    val = np.where((c & 0x7F) == 0x7F, np.nan, val)
    return (sign * val).astype(np.float32)


def round_to_fp16(x) -> np.ndarray:
    """Rounds (via float32, as the kernels do) to the nearest fp16; returns float32."""
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


def bf16_bits(x) -> np.ndarray:
    """float32 values -> uint16 bfloat16 bit patterns, round to nearest even."""
    f = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    u = f.view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(f)
    out = np.where(nan, (u >> 16) | 0x40, rounded)  # keep NaN quiet
    return out.astype(np.uint16)


def bf16_from_bits(bits) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> float32."""
    b = np.ascontiguousarray(np.asarray(bits, dtype=np.uint16))
    return (b.astype(np.uint32) << 16).view(np.float32)


def round_to_bf16(x) -> np.ndarray:
    """Rounds (via float32) to the nearest bfloat16; returns float32."""
    return bf16_from_bits(bf16_bits(x))


def fp16_bytes(x) -> np.ndarray:
    """Float array ``[...]`` -> little-endian fp16 bytes ``uint8[..., 2]``."""
    h = np.ascontiguousarray(np.asarray(x, dtype=np.float32).astype("<f2"))
    return h.view(np.uint8).reshape(*h.shape, 2)


def fp16_from_bytes(b) -> np.ndarray:
    """Little-endian fp16 bytes ``uint8[..., 2]`` -> float32 ``[...]``."""
    b = np.ascontiguousarray(np.asarray(b, dtype=np.uint8))
    return b.view("<f2")[..., 0].astype(np.float32)


def bf16_bytes(x) -> np.ndarray:
    """Float array ``[...]`` -> little-endian bf16 bytes ``uint8[..., 2]``."""
    h = np.ascontiguousarray(bf16_bits(x).astype("<u2"))
    return h.view(np.uint8).reshape(*h.shape, 2)


def bf16_from_bytes(b) -> np.ndarray:
    """Little-endian bf16 bytes ``uint8[..., 2]`` -> float32 ``[...]``."""
    b = np.ascontiguousarray(np.asarray(b, dtype=np.uint8))
    return bf16_from_bits(b.view("<u2")[..., 0])
