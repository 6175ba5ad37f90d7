"""How kernels address the paged cache: over a uint8 or uint16 view.

Every field of a slot starts at an even byte and is a whole number of 16-bit
little-endian words (slot_bytes is even; code streams of 3/4/8-bit elements
at the supported head dims are multiples of 2 bytes; fp16 fields are words).
The store writes words (`CacheWords.store`). The attention kernels read a
field as one contiguous byte tile per key (`CacheWords.load_bytes`): lanes
along the slot, so Triton vectorises the loads to the alignment the slot
stride allows and a warp reads contiguous memory; 4-bit codes are paired into
16-bit words (`CacheWords.load_words`) and split out in registers by shifts
(`kernel_math.codes_from_words`).

Why two views: the Pallas Triton lowering addresses an array with 32-bit
element offsets whenever the array holds at most 2**32 bytes, and Triton's
pointer arithmetic sign-extends 32-bit offsets, so byte offsets in
[2**31, 2**32) of a uint8 array would wrap. For caches in that size range the
wrapper hands the kernel a uint16 view (element offsets < 2**31); below it
(32-bit offsets are exact) and above it (the lowering switches to 64-bit
offsets) the kernel reads the uint8 cache directly, which costs no copy. (XLA
implements the uint16 view as a copy of the cache, the CPU compiler shows: a
fusion of shifts, not a bitcast, so that size range pays a cache copy per call.)
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltriton

from tq_spec import Layout

from . import kernel_math as km

_I32_SAFE_BYTES = 2**31
_I64_OFFSET_BYTES = 2**32  # the lowering uses 64-bit offsets above this size


def needs_word_view(cache_shape) -> bool:
    """True if a uint8 cache of this shape must be passed as uint16 words."""
    n = 1
    for s in cache_shape:
        n *= int(s)
    return _I32_SAFE_BYTES <= n <= _I64_OFFSET_BYTES


def to_word_view(kv_cache):
    """uint8 ``[N, P, Hkv, S]`` -> uint16 ``[N, P, Hkv, S // 2]`` (little-endian pairs)."""
    n, p, h, s = kv_cache.shape
    return lax.bitcast_convert_type(kv_cache.reshape(n, p, h, s // 2, 2), jnp.uint16)


def from_word_view(words):
    """Inverse of `to_word_view`."""
    n, p, h, w = words.shape
    return lax.bitcast_convert_type(words, jnp.uint8).reshape(n, p, h, 2 * w)


@dataclass(frozen=True)
class WordFields:
    """Word offsets (16-bit units from the slot start) of the fields of a layout."""

    key: int
    key_words: int
    key_norm: int | None
    value: int
    value_words: int
    value_scale: int | None
    value_zero: int | None
    slot_words: int

    @staticmethod
    def of(lay: Layout) -> "WordFields":
        def half(x):
            if x is None:
                return None
            if x % 2:
                raise NotImplementedError(
                    f"preset {lay.preset.name!r} at head_dim {lay.head_dim}: field at odd byte {x}; "
                    "tq_jax kernels address 16-bit words"
                )
            return x // 2

        return WordFields(
            key=half(lay.key_offset), key_words=half(lay.key_bytes), key_norm=half(lay.key_norm_offset),
            value=half(lay.value_offset), value_words=half(lay.value_bytes),
            value_scale=half(lay.value_scale_offset), value_zero=half(lay.value_zero_offset),
            slot_words=half(lay.slot_bytes),
        )


@dataclass(frozen=True)
class CacheWords:
    """Word loads/stores on the cache ref, whichever view the kernel received.

    ``word_view``: the ref is uint16 ``[N, P, Hkv, S/2]`` (or float16/bfloat16, the dequant
    workspace, whose raw fields `load_halves` reads as they are); else uint8 ``[N, P, Hkv, S]``.
    Index arguments broadcast against each other (scalars or int32 arrays).
    """

    word_view: bool

    def load(self, ref, blk, off, head, word):
        """int32 words (0..65535) at word index `word` of slot (blk, off, head)."""
        if self.word_view:
            return ref[blk, off, head, word].astype(jnp.int32)
        lo = ref[blk, off, head, 2 * word].astype(jnp.int32)
        hi = ref[blk, off, head, 2 * word + 1].astype(jnp.int32)
        return lo | (hi << 8)

    def load_bytes(self, ref, blk, off, head, byte0: int, width: int, count: int, mask):
        """uint8 ``[BN, width]``: bytes ``byte0 + j`` of the slots ``(blk, off, head)``.

        Lanes ``j >= count`` and keys with ``mask [BN]`` False read nothing and
        come back 0 (``mask=None``: every key reads, so every address must be inside the
        cache). ``byte0`` and ``count`` are even (fields are whole words).
        On the uint8 view the lanes read consecutive bytes of one slot, so
        Triton issues loads as wide as the slot alignment it can prove (2 bytes
        for 134/102/118-byte slots, 4 for 196, 16 for 512) and a warp reads
        contiguous memory; each byte is read once.
        """
        blk2, off2 = blk[:, None], off[:, None]
        if not self.word_view:
            j = lax.broadcasted_iota(jnp.int32, (1, width), 1)
            m = _and_masks(mask, j < count if count < width else None)
            return _load(ref, (blk2, off2, head, byte0 + j), m)
        w = lax.broadcasted_iota(jnp.int32, (1, width // 2), 1)
        m = _and_masks(mask, w < count // 2 if count < width else None)
        words = _load(ref, (blk2, off2, head, byte0 // 2 + w), m).astype(jnp.int32)
        return km.words_to_bytes(words).astype(jnp.uint8)

    def load_words(self, ref, blk, off, head, byte0: int, width: int, count: int, mask):
        """int32 ``[BN, width]`` (0..65535): words ``j`` of the field at byte ``byte0`` of each slot.

        `load_bytes` of ``2 * width`` bytes, paired in registers (each thread holds whole
        words, so the pairing moves no data); words ``j >= count`` and masked keys come back 0.
        """
        if self.word_view:
            w = lax.broadcasted_iota(jnp.int32, (1, width), 1)
            m = _and_masks(mask, w < count if count < width else None)
            return _load(ref, (blk[:, None], off[:, None], head, byte0 // 2 + w), m).astype(jnp.int32)
        return km.bytes_to_words(self.load_bytes(ref, blk, off, head, byte0, 2 * width, 2 * count, mask))

    def load_halves(self, ref, blk, off, head, byte0: int, width: int, count: int, mask):
        """``[BN, width]`` 16-bit elements of the field at byte ``byte0`` (fp16/bf16 keys or
        values): the ref's own elements where it is a float16/bfloat16 view (the dequant
        workspace), else int32 words (`load_words`).

        A float view hands a dot its operand straight from the load: Triton then feeds the
        MMA from the pipelined copy in shared memory, where a tile of words would first
        come into registers to be bitcast and go back to shared memory.
        """
        if not (self.word_view and jnp.issubdtype(ref.dtype, jnp.floating)):
            return self.load_words(ref, blk, off, head, byte0, width, count, mask)
        w = lax.broadcasted_iota(jnp.int32, (1, width), 1)
        m = _and_masks(mask, w < count if count < width else None)
        return _load(ref, (blk[:, None], off[:, None], head, byte0 // 2 + w), m)

    def load_byte_planes(self, ref, blk, off, head, byte0: int, groups: int, count: int, mask):
        """Three uint8 ``[BN, groups]`` planes: bytes ``byte0 + 3g + i`` (i = 0, 1, 2) of each slot.

        For 3-bit streams (8 codes in 3 bytes): the planes are strided byte
        reads, but a warp still covers a slot's contiguous bytes. Groups
        ``g >= count`` and keys with `mask` False read nothing (0).
        """
        blk2, off2 = blk[:, None], off[:, None]
        g = lax.broadcasted_iota(jnp.int32, (1, groups), 1)
        m = _and_masks(mask, g < count if count < groups else None)
        planes = []
        for i in range(3):
            byte = byte0 + 3 * g + i
            if not self.word_view:
                planes.append(_load(ref, (blk2, off2, head, byte), m))
            else:
                w = _load(ref, (blk2, off2, head, byte >> 1), m).astype(jnp.int32)
                planes.append((lax.shift_right_logical(w, (byte & 1) * 8) & 0xFF).astype(jnp.uint8))
        return tuple(planes)

    def load_half(self, ref, blk, off, head, byte: int, mask):
        """int32 ``[BN]``: the 16-bit field at (even) `byte` of each slot; 0 where `mask` is False."""
        if self.word_view:
            return _load(ref, (blk, off, head, byte // 2), mask).astype(jnp.int32)
        pair = self.load_bytes(ref, blk, off, head, byte, 2, 2, mask)  # one 2-byte load per key
        return km.bytes_to_words(pair).reshape(blk.shape)

    def store(self, ref, blk, off, head, word, value, mask=None):
        """Writes int32 words (low 16 bits) at `word`; lanes with mask False write nothing.

        Lanes must address distinct words: interpret mode implements a masked
        store as read-modify-write of every lane, so two lanes on one address
        would race; distinct addresses make masked lanes rewrite what is there.
        """
        value = value.astype(jnp.int32)
        if self.word_view:
            _store(ref, (blk, off, head, word), (value & 0xFFFF).astype(jnp.uint16), mask)
            return
        _store(ref, (blk, off, head, 2 * word), (value & 0xFF).astype(jnp.uint8), mask)
        _store(ref, (blk, off, head, 2 * word + 1), ((value >> 8) & 0xFF).astype(jnp.uint8), mask)


def _and_masks(key_mask, lane_mask):
    """``key_mask [BN]`` (or None: every key) as ``[BN, 1]``, ANDed with ``lane_mask [1, W]`` (or None)."""
    if key_mask is None:
        return lane_mask
    return key_mask[:, None] if lane_mask is None else key_mask[:, None] & lane_mask


def _load(ref, idx, mask):
    """``ref[idx]``; elements where `mask` is False read nothing and come back 0 (None: all read).
    An unmasked load is one plain load per register: no zeroing before it, no merge after it."""
    if mask is None:
        return pltriton.load(ref.at[idx])
    return pltriton.load(ref.at[idx], mask=mask, other=0)


def _store(ref, idx, value, mask):
    if mask is None:
        ref[idx] = value
    else:
        pltriton.store(ref.at[idx], value, mask=mask)
