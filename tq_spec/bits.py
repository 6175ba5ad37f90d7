"""LSB-first bit packing of small integer codes.

Element ``i`` of a ``b``-bit stream occupies bits ``[i*b, i*b + b)`` counted
from bit 0 of byte 0. For 4 bits the low nibble holds the even element; for 3
bits, 8 codes fill 3 bytes.
"""

from __future__ import annotations

import numpy as np

from .layout import packed_bytes


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= int(bits) <= 8:
        raise ValueError(f"bits: expected an int in [1, 8], got {bits!r}")
    return int(bits)


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Packs ``codes[..., n]`` (values in ``[0, 2**bits)``) into ``uint8[..., ceil(n*bits/8)]``."""
    bits = _check_bits(bits)
    codes = np.asarray(codes)
    if codes.size and (codes.min() < 0 or codes.max() >= (1 << bits)):
        raise ValueError(
            f"codes: expected values in [0, {1 << bits}) for {bits}-bit packing, "
            f"got range [{codes.min()}, {codes.max()}]"
        )
    n = codes.shape[-1]
    # Expand each code into its bits (LSB first), lay the bit stream out flat,
    # pad to whole bytes and fold back 8 bits per byte.
    shifts = np.arange(bits, dtype=np.uint16)
    stream = ((codes[..., None].astype(np.uint16) >> shifts) & 1).astype(np.uint8)
    stream = stream.reshape(*codes.shape[:-1], n * bits)
    nbytes = packed_bytes(n, bits)
    pad = nbytes * 8 - n * bits
    if pad:
        stream = np.concatenate(
            [stream, np.zeros((*codes.shape[:-1], pad), np.uint8)], axis=-1
        )
    stream = stream.reshape(*codes.shape[:-1], nbytes, 8)
    return (stream << np.arange(8, dtype=np.uint8)).sum(axis=-1, dtype=np.uint16).astype(np.uint8)


def unpack_bits(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Inverse of `pack_bits`: ``uint8[..., >=ceil(n*bits/8)]`` -> ``uint8[..., n]``."""
    bits = _check_bits(bits)
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise TypeError(f"packed: expected uint8, got {packed.dtype}")
    need = packed_bytes(n, bits)
    if packed.shape[-1] < need:
        raise ValueError(
            f"packed: {n} codes of {bits} bits need {need} bytes, got {packed.shape[-1]}"
        )
    stream = (packed[..., :need, None] >> np.arange(8, dtype=np.uint8)) & 1
    stream = stream.reshape(*packed.shape[:-1], need * 8)[..., : n * bits]
    stream = stream.reshape(*packed.shape[:-1], n, bits).astype(np.uint8)
    return (stream << np.arange(bits, dtype=np.uint8)).sum(axis=-1, dtype=np.uint16).astype(np.uint8)
