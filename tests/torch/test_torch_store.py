"""tq_torch.store_kv bytes vs the float64 reference (CPU: Triton interpreter).

fp8 keys: the Triton interpreter's fp32 -> fp8 cast loses the rounding carry
(DESIGN.md section 7). The kernel never uses that cast: it encodes fp8 with
exact integer arithmetic on every backend, so fp8 bytes (and every fp16 / bf16
field) are compared EXACTLY here (``field_ulps=0``), carry cases included.
Integer code fields may differ only at bucket boundaries (parity.tolerances).
"""

from __future__ import annotations

import zlib

import pytest
import torch

import tq_spec
import tq_torch
from parity.tolerances import compare_store
from tq_torch_testlib import device


def _head_dims(preset):
    return (64, 128) if tq_spec.get_preset(preset).key_format == "mse" else (40, 64)


def _special_rows(key, value, preset):
    """Plants values that stress rounding: fp8 carry/saturation/subnormals, flat values."""
    d = key.shape[-1]
    if tq_spec.get_preset(preset).key_format == "fp8":
        specials = torch.tensor([1.9747, -1.9747, 1000.0, -1000.0, 448.0, 464.0, 0.0012, -2.0**-9,
                                 2.0**-10, 3 * 2.0**-10, 0.0, -0.0, 240.0, 15.5, 1e-30, 447.9])
        key[0, 0, :specials.numel()] = specials
    value[1, 0, :] = 0.375          # constant vector: scale hits its 1e-8 floor
    value[2, -1, :] = torch.linspace(-3, 3, d)  # many values on exact bucket centres
    key[3, 0, :] = 0.0              # zero key: norm 0, unit vector 0
    return key, value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("preset", tq_spec.PRESET_NAMES)
def test_store_matches_reference(preset, dtype):
    dev = device()
    gen = torch.Generator().manual_seed(zlib.crc32(f"{preset}/{dtype}".encode()))
    for d in _head_dims(preset):
        t, hkv, n, p = 11, 3, 5, 4
        lay = tq_spec.layout(preset, d)
        cache = torch.randint(0, 256, (n, p, hkv, lay.slot_bytes), dtype=torch.uint8, generator=gen)
        key = torch.randn(t, hkv, d, generator=gen) * 4
        value = torch.randn(t, hkv, d, generator=gen) * 2 + 1
        key, value = _special_rows(key, value, preset)
        # Shuffled distinct slots, two tokens skipped; int32 and int64 both accepted.
        slots = torch.randperm(n * p, generator=gen)[:t]
        slots[[4, 9]] = -1
        slot_dtype = torch.int64 if d % 16 == 0 else torch.int32
        key, value = key.to(dtype), value.to(dtype)
        before = cache.clone()
        out_cache = cache.to(dev)
        ret = tq_torch.store_kv(key.to(dev), value.to(dev), out_cache, slots.to(dev, slot_dtype), preset=preset)
        assert ret is out_cache
        cmp = compare_store(out_cache, key, value, before, slots, preset=preset, field_ulps=0)
        assert cmp.ok, cmp.describe()


def test_store_custom_rotation_and_codebook():
    preset, d = "turboquant_k3v4_nc", 64
    rot = tq_spec.rotation(d, "randomized_hadamard", seed=3)
    cb = tq_spec.codebook(d, 3, flavor="exact")
    lay = tq_spec.layout(preset, d)
    gen = torch.Generator().manual_seed(5)
    cache = torch.randint(0, 256, (3, 4, 2, lay.slot_bytes), dtype=torch.uint8, generator=gen)
    key = torch.randn(6, 2, d, generator=gen)
    value = torch.randn(6, 2, d, generator=gen)
    slots = torch.tensor([0, 5, 11, -1, 3, 7])
    before = cache.clone()
    dev_cache = cache.to(device())
    tq_torch.store_kv(key.to(device()), value.to(device()), dev_cache, slots.to(device()), preset=preset,
                      rotation=rot, codebook=cb)
    cmp = compare_store(dev_cache, key, value, before, slots, preset=preset, rotation=rot, codebook=cb,
                        field_ulps=0)
    assert cmp.ok, cmp.describe()
    default = compare_store(dev_cache, key, value, before, slots, preset=preset, field_ulps=0)
    assert not default.ok, "custom rotation/codebook must change the stored codes"


def test_store_all_skipped_leaves_cache_untouched():
    lay = tq_spec.layout("turboquant_4bit_nc", 64)
    cache = torch.randint(0, 256, (2, 2, 1, lay.slot_bytes), dtype=torch.uint8).to(device())
    before = cache.clone()
    tq_torch.store_kv(torch.randn(3, 1, 64, device=device()), torch.randn(3, 1, 64, device=device()), cache,
                      torch.full((3,), -1, device=device()), preset="turboquant_4bit_nc")
    assert torch.equal(cache, before)


@pytest.mark.parametrize("preset", tq_spec.PRESET_NAMES)
def test_dequantize_cache_matches_reference(preset):
    d = 64
    lay = tq_spec.layout(preset, d)
    gen = torch.Generator().manual_seed(1)
    dev = device()
    cache = torch.zeros(2, 3, 2, lay.slot_bytes, dtype=torch.uint8, device=dev)
    tq_torch.store_kv(torch.randn(6, 2, d, generator=gen).to(dev), torch.randn(6, 2, d, generator=gen).to(dev),
                      cache, torch.arange(6, device=dev), preset=preset)
    k, v = tq_torch.dequantize_cache(cache, preset=preset, head_dim=d)
    rk, rv = tq_spec.reference.dequantize_cache(cache.cpu().numpy(), preset=preset, head_dim=d)
    assert k.dtype == v.dtype == torch.float32 and k.shape == (2, 3, 2, d)
    torch.testing.assert_close(k.cpu().double(), torch.from_numpy(rk), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v.cpu().double(), torch.from_numpy(rv), rtol=1e-5, atol=1e-6)
