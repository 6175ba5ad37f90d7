"""Cache presets: what a slot stores for the key part and the value part.

A preset is data, not code: kernels branch on its fields (`key_format`,
`key_bits`, `value_bits`, ...) so that one kernel family serves every bit width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

KeyFormat = Literal["fp8", "mse", "raw"]
ValueFormat = Literal["uniform", "raw"]


@dataclass(frozen=True)
class Preset:
    """One cache format.

    Attributes:
      name: the public name (e.g. ``"turboquant_k8v4"``).
      key_format: ``"fp8"`` (fp8 e4m3fn per element), ``"mse"`` (rotated
        Lloyd-Max codebook indices plus an fp16 norm) or ``"raw"`` (bf16/fp16).
      key_bits: bits per key element (8 for fp8, 3 or 4 for mse, 16 for raw).
      value_format: ``"uniform"`` (asymmetric per-token min/max codes plus fp16
        scale and zero) or ``"raw"``.
      value_bits: bits per value element (3 or 4 for uniform, 16 for raw).
      norm_correction: mse keys only; decode divides the gathered centroid
        vector by its own L2 norm (the ``_nc`` presets).
      raw_dtype: element dtype name of raw presets (``"bfloat16"``/``"float16"``).
    """

    name: str
    key_format: KeyFormat
    key_bits: int
    value_format: ValueFormat
    value_bits: int
    norm_correction: bool = False
    raw_dtype: str | None = None

    @property
    def is_quantized(self) -> bool:
        return self.key_format != "raw"

    @property
    def value_levels(self) -> int:
        """Number of value code levels (``2**value_bits``) for uniform values."""
        return 1 << self.value_bits


_PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("turboquant_k8v4", "fp8", 8, "uniform", 4),
        Preset("turboquant_4bit_nc", "mse", 4, "uniform", 4, norm_correction=True),
        Preset("turboquant_k3v4_nc", "mse", 3, "uniform", 4, norm_correction=True),
        Preset("turboquant_3bit_nc", "mse", 3, "uniform", 3, norm_correction=True),
        Preset("bf16", "raw", 16, "raw", 16, raw_dtype="bfloat16"),
        Preset("fp16", "raw", 16, "raw", 16, raw_dtype="float16"),
    )
}

PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)

PresetLike = Union[str, Preset]


def get_preset(preset: PresetLike) -> Preset:
    """Looks a preset up by name (a `Preset` passes through).

    Raises:
      ValueError: unknown name; the message lists the valid names.
      TypeError: neither a string nor a `Preset`.
    """
    if isinstance(preset, Preset):
        return preset
    if not isinstance(preset, str):
        raise TypeError(
            f"preset: expected a preset name (str) or tq_spec.Preset, got {type(preset).__name__}"
        )
    try:
        return _PRESETS[preset]
    except KeyError:
        raise ValueError(
            f"preset: unknown preset {preset!r}; valid presets are {', '.join(PRESET_NAMES)}"
        ) from None
