import pytest

import tq_spec

GOLDEN_SLOT_BYTES = {
    # preset: {head_dim: slot_bytes}; DESIGN.md section 2 / vLLM 0.33.
    "turboquant_k8v4": {64: 100, 128: 196, 256: 388},
    "turboquant_4bit_nc": {64: 70, 128: 134, 256: 262},
    "turboquant_k3v4_nc": {64: 62, 128: 118, 256: 230},
    "turboquant_3bit_nc": {64: 54, 128: 102, 256: 198},
    "bf16": {64: 256, 128: 512, 256: 1024},
    "fp16": {64: 256, 128: 512, 256: 1024},
}


@pytest.mark.parametrize("preset", sorted(GOLDEN_SLOT_BYTES))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_golden_slot_bytes(preset, head_dim):
    assert tq_spec.layout(preset, head_dim).slot_bytes == GOLDEN_SLOT_BYTES[preset][head_dim]


def test_preset_names_are_the_contract():
    assert set(tq_spec.PRESET_NAMES) == set(GOLDEN_SLOT_BYTES)


@pytest.mark.parametrize("preset", tq_spec.PRESET_NAMES)
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_fields_tile_the_slot(preset, head_dim):
    lay = tq_spec.layout(preset, head_dim)
    p = lay.preset
    spans = [(lay.key_offset, lay.key_bytes), (lay.value_offset, lay.value_bytes)]
    if p.key_format == "mse":
        spans.append((lay.key_norm_offset, 2))
    if p.value_format == "uniform":
        spans += [(lay.value_scale_offset, 2), (lay.value_zero_offset, 2)]
    spans.sort()
    cursor = 0
    for off, size in spans:
        assert off == cursor, (spans, lay)
        cursor = off + size
    assert lay.used_bytes == cursor
    assert lay.slot_bytes in (cursor, cursor + 1) and lay.slot_bytes % 2 == 0
    expected_key = {"fp8": head_dim, "raw": 2 * head_dim}.get(p.key_format, -(-head_dim * p.key_bits // 8))
    assert lay.key_bytes == expected_key


def test_plain_presets_accept_multiples_of_eight():
    lay = tq_spec.layout("turboquant_k8v4", 40)
    assert (lay.key_bytes, lay.value_bytes, lay.slot_bytes) == (40, 20, 64)
    assert tq_spec.layout("bf16", 96).slot_bytes == 384


@pytest.mark.parametrize("preset,head_dim", [
    ("turboquant_4bit_nc", 96), ("turboquant_3bit_nc", 32), ("turboquant_k3v4_nc", 1024),
    ("turboquant_k8v4", 36), ("bf16", 24), ("fp16", 520),
])
def test_unsupported_head_dim_is_a_clear_error(preset, head_dim):
    with pytest.raises(ValueError, match=rf"head_dim: .*{preset}.*got {head_dim}"):
        tq_spec.layout(preset, head_dim)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="preset: unknown preset 'int4'.*turboquant_k8v4.*fp16"):
        tq_spec.get_preset("int4")
    with pytest.raises(TypeError, match="preset: expected a preset name"):
        tq_spec.get_preset(3)


def test_presets_are_frozen():
    p = tq_spec.get_preset("turboquant_k8v4")
    assert tq_spec.get_preset(p) is p
    with pytest.raises(AttributeError):
        p.key_bits = 4
