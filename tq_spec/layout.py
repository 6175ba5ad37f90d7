"""Byte layout of one cache slot (one token, one kv head): K part then V part.

Cache tensor: ``uint8[num_blocks, block_size, num_kv_heads, slot_bytes]``.
All multi-byte fields are little-endian; the slot is rounded up to even bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .presets import Preset, PresetLike, get_preset

# Head dims supported by rotated (mse) presets: the Hadamard rotation needs a
# power of two; 64..512 is what the kernels tile.
MSE_HEAD_DIMS = (64, 128, 256, 512)
# fp8-key and raw presets need no rotation: any multiple of 8 in this range.
PLAIN_HEAD_DIM_MIN, PLAIN_HEAD_DIM_MAX, PLAIN_HEAD_DIM_STEP = 32, 512, 8


def packed_bytes(num_elements: int, bits: int) -> int:
    """Bytes of an LSB-first bit stream of `num_elements` codes of `bits` bits."""
    return (num_elements * bits + 7) // 8


@dataclass(frozen=True)
class Layout:
    """Field offsets (bytes from the slot start) for one (preset, head_dim).

    ``key_norm_offset`` is None unless keys are mse; ``value_scale_offset`` and
    ``value_zero_offset`` are None for raw values.
    """

    preset: Preset
    head_dim: int
    key_offset: int
    key_bytes: int
    key_norm_offset: int | None
    value_offset: int
    value_bytes: int
    value_scale_offset: int | None
    value_zero_offset: int | None
    slot_bytes: int

    @property
    def used_bytes(self) -> int:
        """Bytes actually written; ``slot_bytes`` may add one pad byte."""
        end = self.value_offset + self.value_bytes
        if self.value_zero_offset is not None:
            end = self.value_zero_offset + 2
        return end


def check_head_dim(preset: PresetLike, head_dim) -> int:
    """Returns `head_dim` if `preset` supports it, else raises ValueError."""
    p = get_preset(preset)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        try:
            import numbers

            if not isinstance(head_dim, numbers.Integral):
                raise TypeError
            head_dim = int(head_dim)
        except TypeError:
            raise TypeError(
                f"head_dim: expected an int, got {type(head_dim).__name__}"
            ) from None
    if p.key_format == "mse":
        if head_dim not in MSE_HEAD_DIMS:
            raise ValueError(
                f"head_dim: preset {p.name!r} rotates keys with a Hadamard matrix and needs a "
                f"power of two in {MSE_HEAD_DIMS}, got {head_dim}"
            )
    elif not (
        PLAIN_HEAD_DIM_MIN <= head_dim <= PLAIN_HEAD_DIM_MAX
        and head_dim % PLAIN_HEAD_DIM_STEP == 0
    ):
        raise ValueError(
            f"head_dim: preset {p.name!r} needs a multiple of {PLAIN_HEAD_DIM_STEP} in "
            f"[{PLAIN_HEAD_DIM_MIN}, {PLAIN_HEAD_DIM_MAX}], got {head_dim}"
        )
    return head_dim


@lru_cache(maxsize=None)
def _layout(p: Preset, head_dim: int) -> Layout:
    d = head_dim
    if p.key_format == "raw":
        key_bytes, norm_off = 2 * d, None
        value_off = key_bytes
        value_bytes, scale_off, zero_off = 2 * d, None, None
        end = value_off + value_bytes
    else:
        if p.key_format == "fp8":
            key_bytes, norm_off = d, None
            value_off = key_bytes
        else:
            key_bytes = packed_bytes(d, p.key_bits)
            norm_off = key_bytes
            value_off = norm_off + 2
        value_bytes = packed_bytes(d, p.value_bits)
        scale_off = value_off + value_bytes
        zero_off = scale_off + 2
        end = zero_off + 2
    return Layout(
        preset=p,
        head_dim=d,
        key_offset=0,
        key_bytes=key_bytes,
        key_norm_offset=norm_off,
        value_offset=value_off,
        value_bytes=value_bytes,
        value_scale_offset=scale_off,
        value_zero_offset=zero_off,
        slot_bytes=end + (end % 2),
    )


def layout(preset: PresetLike, head_dim: int) -> Layout:
    """The slot layout of `preset` at `head_dim`.

    Raises:
      ValueError: unknown preset, or a head_dim the preset does not support.
    """
    p = get_preset(preset)
    return _layout(p, check_head_dim(p, head_dim))
