"""tq_spec: the framework-free TurboQuant cache contract (numpy only).

Presets, slot layouts, codebooks, rotations, bit packing, small-float codecs,
argument validation, the dispatch table, and (in `tq_spec.reference`) the
float64 oracle of every op.
"""

from . import dispatch, reference, validation
from .bits import pack_bits, unpack_bits
from .codebook import CODEBOOK_FLAVORS, Codebook, codebook
from .floats import (
    FP8_E4M3FN_MAX,
    bf16_bytes,
    bf16_from_bytes,
    fp16_bytes,
    fp16_from_bytes,
    fp8_e4m3fn_decode,
    fp8_e4m3fn_encode,
    round_to_bf16,
    round_to_fp16,
)
from .layout import Layout, layout, packed_bytes
from .params import QuantParams, quant_params
from .presets import PRESET_NAMES, Preset, get_preset
from .rotation import DEFAULT_ROTATION_SEED, ROTATION_KINDS, rotation, rotation_signs

__all__ = [
    "CODEBOOK_FLAVORS", "Codebook", "DEFAULT_ROTATION_SEED", "FP8_E4M3FN_MAX", "Layout",
    "PRESET_NAMES", "Preset", "QuantParams", "ROTATION_KINDS", "bf16_bytes", "bf16_from_bytes",
    "codebook", "dispatch", "fp16_bytes", "fp16_from_bytes", "fp8_e4m3fn_decode",
    "fp8_e4m3fn_encode", "get_preset", "layout", "pack_bits", "packed_bytes", "quant_params",
    "reference", "rotation", "rotation_signs", "round_to_bf16", "round_to_fp16", "unpack_bits",
    "validation",
]
