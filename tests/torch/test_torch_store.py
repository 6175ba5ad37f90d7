"""tq_torch.store_kv bytes vs the float64 reference (CPU: Triton interpreter).

fp8 keys: the Triton interpreter's fp32 -> fp8 cast loses the rounding carry
(DESIGN.md section 7). The kernel never uses that cast: it encodes fp8 with
exact integer arithmetic on every backend, so fp8 bytes (and every fp16 / bf16
field) are compared EXACTLY here (``field_ulps=0``), carry cases included.
Integer code fields may differ only at bucket boundaries (parity.tolerances).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

import triton
import triton.language as tl

import tq_spec
import tq_torch
from parity.tolerances import compare_store
from tq_torch._src.store import bucketize
from tq_torch_testlib import device


@triton.jit
def _bucketize_kernel(y_ptr, mid_ptr, out_ptr, N: tl.constexpr, BITS: tl.constexpr, MID_MODE: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, bucketize(tl.load(y_ptr + i), mid_ptr, BITS, MID_MODE))


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


# ----------------------------------------------------------------------------- memory safety, kernel variants


def _guarded_cache(n, p, hkv, slot_bytes, gen, guard=4096):
    """A random cache that is a view into a larger random buffer (guard bytes on both sides)."""
    buf = torch.randint(0, 256, (guard + n * p * hkv * slot_bytes + guard,), dtype=torch.uint8, generator=gen)
    return buf, guard


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4", "turboquant_3bit_nc", "bf16"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_bad_slots_write_nothing(preset, slot_dtype):
    """Slots outside [0, N*P) -- -1 padding, other negatives, N*P and beyond, values that wrap
    when narrowed to 32 bits -- write nothing, inside or outside the cache (DESIGN.md section 3)."""
    dev = device()
    d, hkv, n, p = 64, 2, 5, 4
    lay = tq_spec.layout(preset, d)
    gen = torch.Generator().manual_seed(17)
    buf, guard = _guarded_cache(n, p, hkv, lay.slot_bytes, gen)
    bad = [-1, -5, n * p, n * p + 3, 2**31 - 1, -(2**31)]
    if slot_dtype == torch.int64:
        bad += [2**40, -(2**40), 2**32 + 3, 2**31, 2**63 - 1]
    good = [3, 0, n * p - 1, 9]
    slots = torch.tensor(bad[: len(bad) // 2] + good + bad[len(bad) // 2:], dtype=slot_dtype)
    t = slots.numel()
    key = torch.randn(t, hkv, d, generator=gen)
    value = torch.randn(t, hkv, d, generator=gen)
    before = buf.clone()
    dev_buf = buf.to(dev)
    cache = dev_buf[guard:guard + n * p * hkv * lay.slot_bytes].view(n, p, hkv, lay.slot_bytes)
    tq_torch.store_kv(key.to(dev), value.to(dev), cache, slots.to(dev), preset=preset, validate=False)
    after = dev_buf.cpu()
    assert torch.equal(after[:guard], before[:guard]) and torch.equal(after[-guard:], before[-guard:])
    ref_slots = torch.where((slots >= 0) & (slots < n * p), slots, -1)
    inner = before[guard:guard + n * p * hkv * lay.slot_bytes].view(n, p, hkv, lay.slot_bytes)
    cmp = compare_store(cache, key, value, inner, ref_slots, preset=preset, field_ulps=0)
    assert cmp.ok, cmp.describe()
    assert cmp.slots_written == len(good)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_general_rotation(dtype):
    """A rotation that is not +-c (a random orthogonal matrix) takes the split-bf16 general path."""
    preset, d = "turboquant_4bit_nc", 64
    rng = np.random.default_rng(2)
    rot = np.linalg.qr(rng.standard_normal((d, d)))[0].astype(np.float32)
    gen = torch.Generator().manual_seed(3)
    lay = tq_spec.layout(preset, d)
    cache = torch.randint(0, 256, (4, 4, 2, lay.slot_bytes), dtype=torch.uint8, generator=gen)
    key = (torch.randn(9, 2, d, generator=gen) * 3).to(dtype)
    value = torch.randn(9, 2, d, generator=gen).to(dtype)
    slots = torch.tensor([0, 5, 11, -1, 3, 7, 15, 2, 8])
    for rotation in (rot, torch.from_numpy(rot)):
        out = cache.clone().to(device())
        tq_torch.store_kv(key.to(device()), value.to(device()), out, slots.to(device()), preset=preset,
                          rotation=rotation)
        cmp = compare_store(out, key, value, cache, slots, preset=preset, rotation=rot, field_ulps=0)
        assert cmp.ok, cmp.describe()


@pytest.mark.parametrize("kind", ["asymmetric", "symmetric_exact"])
def test_store_other_codebooks(kind):
    """Codebooks the symmetric search does not apply to (asymmetric) and another symmetric one."""
    preset, d = "turboquant_k3v4_nc", 64
    if kind == "symmetric_exact":
        cb = tq_spec.codebook(d, 3, flavor="exact")
    else:
        c = np.sort(np.random.default_rng(4).normal(0.05, 0.12, 8)).astype(np.float32)
        cb = tq_spec.Codebook(d, 3, "custom", c, ((c[:-1] + c[1:]) / np.float32(2)).astype(np.float32))
    gen = torch.Generator().manual_seed(6)
    lay = tq_spec.layout(preset, d)
    cache = torch.randint(0, 256, (3, 4, 2, lay.slot_bytes), dtype=torch.uint8, generator=gen)
    key = torch.randn(10, 2, d, generator=gen).to(torch.bfloat16)
    value = torch.randn(10, 2, d, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([0, 5, 11, -1, 3, 7, 1, 2, 8, 10])
    out = cache.clone().to(device())
    tq_torch.store_kv(key.to(device()), value.to(device()), out, slots.to(device()), preset=preset, codebook=cb)
    cmp = compare_store(out, key, value, cache, slots, preset=preset, codebook=cb, field_ulps=0)
    assert cmp.ok, cmp.describe()


def test_store_value_codes_are_the_fp32_chain():
    """Value codes and fp16 fields equal, bit for bit, ``floor(RN(RN(RN(v - lo) / scale) + 0.5))``
    in IEEE fp32 (what the kernel computes on every backend), on bf16 data full of exact ties."""
    preset, d = "turboquant_k8v4", 128
    lay = tq_spec.layout(preset, d)
    gen = torch.Generator().manual_seed(8)
    t, hkv = 64, 4
    # Values on a coarse grid: positions land exactly on half-integers often.
    value = (torch.randint(-24, 25, (t, hkv, d), generator=gen).float() / 8).to(torch.bfloat16)
    value[::5] = torch.randn(value[::5].shape, generator=gen).to(torch.bfloat16)
    key = torch.randn(t, hkv, d, generator=gen).to(torch.bfloat16)
    cache = torch.zeros(t // 4, 4, hkv, lay.slot_bytes, dtype=torch.uint8, device=device())
    tq_torch.store_kv(key.to(device()), value.to(device()), cache, torch.arange(t, device=device()), preset=preset)
    got = cache.cpu().numpy().reshape(t, hkv, lay.slot_bytes)
    v = value.float().numpy()
    lo, hi = v.min(-1, keepdims=True), v.max(-1, keepdims=True)
    scale = np.maximum((hi - lo) / np.float32(15), np.float32(1e-8)).astype(np.float32)
    codes = np.floor(((v - lo) / scale).astype(np.float32) + np.float32(0.5)).astype(np.int64)
    from tq_spec.bits import unpack_bits
    np.testing.assert_array_equal(unpack_bits(got[..., lay.value_offset:lay.value_offset + lay.value_bytes], 4, d),
                                  np.clip(codes, 0, 15))
    np.testing.assert_array_equal(got[..., lay.value_scale_offset:lay.value_scale_offset + 2].view(np.float16)[..., 0],
                                  scale[..., 0].astype(np.float16))
    np.testing.assert_array_equal(got[..., lay.value_zero_offset:lay.value_zero_offset + 2].view(np.float16)[..., 0],
                                  lo[..., 0].astype(np.float16))


def test_store_many_tiles_and_strided_inputs():
    """More tiles than programs (the tile loop and its prefetch), K/V as strided views of a fused qkv."""
    preset, d, hkv = "turboquant_4bit_nc", 64, 3
    lay = tq_spec.layout(preset, d)
    gen = torch.Generator().manual_seed(9)
    t, n, p = 70, 20, 16
    qkv = torch.randn(t, 3 * hkv, d, generator=gen).to(torch.bfloat16)
    key, value = qkv[:, hkv:2 * hkv], qkv[:, 2 * hkv:]
    slots = torch.randperm(n * p, generator=gen)[:t]
    slots[::7] = -1
    cache = torch.randint(0, 256, (n, p, hkv, lay.slot_bytes), dtype=torch.uint8, generator=gen)
    dev_qkv = qkv.to(device())
    out = cache.clone().to(device())
    tq_torch.store_kv(dev_qkv[:, hkv:2 * hkv], dev_qkv[:, 2 * hkv:], out, slots.to(device()), preset=preset)
    cmp = compare_store(out, key, value, cache, slots, preset=preset, field_ulps=0)
    assert cmp.ok, cmp.describe()


@pytest.mark.parametrize("mode", ["symmetric", "sorted", "any"])
def test_store_every_midpoint_search(monkeypatch, mode):
    """The three code searches (tq_spec codebooks are symmetric, so each one applies) agree with the
    reference, on keys with coordinates exactly on, and next to, the midpoints."""
    from tq_torch._src import store

    preset, d = "turboquant_4bit_nc", 64
    monkeypatch.setattr(store, "midpoint_mode",
                        lambda *a: {"symmetric": store.MID_SYMMETRIC, "sorted": store.MID_SORTED,
                                    "any": store.MID_ANY}[mode])
    qp = tq_spec.quant_params(preset, d)
    mids = qp.codebook.midpoints.astype(np.float32)
    # Unit keys whose rotated coordinates sit on / one ulp around the midpoints: y = Pi^T-rotated back.
    rng = np.random.default_rng(12)
    ys = []
    for m in mids:
        for y0 in (m, np.nextafter(m, np.float32(1)), np.nextafter(m, np.float32(-1)), -m, np.float32(0.0)):
            y = rng.standard_normal(d).astype(np.float32) * np.float32(0.05)
            y[rng.integers(d)] = y0
            ys.append(y)
    y = np.stack(ys)
    key = (y.astype(np.float64) @ qp.rotation.astype(np.float64)).astype(np.float32)  # k = Pi^T y
    t = key.shape[0] // 2
    key = torch.from_numpy(key[: 2 * t].reshape(t, 2, d))
    value = torch.randn(t, 2, d, generator=torch.Generator().manual_seed(1))
    lay = tq_spec.layout(preset, d)
    cache = torch.zeros(t, 1, 2, lay.slot_bytes, dtype=torch.uint8)
    out = cache.clone().to(device())
    tq_torch.store_kv(key.to(device()), value.to(device()), out, torch.arange(t, device=device()), preset=preset)
    cmp = compare_store(out, key, value, cache, torch.arange(t), preset=preset, field_ulps=0)
    assert cmp.ok, cmp.describe()


@pytest.mark.parametrize("bits", [3, 4])
def test_bucketize_is_the_exact_count(bits):
    """`bucketize` (all three searches) equals ``#{j : y >= m_j}`` exactly: on every midpoint, one
    ulp either side, at +-0, +-inf, NaN and at random."""
    from tq_torch._src import store

    mids = tq_spec.codebook(128, bits).midpoints.astype(np.float32)
    special = [np.float32(x) for x in (0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30, -1e-30, 3.0, -3.0)]
    near = [f(m) for m in mids for f in (lambda m: m, lambda m: np.nextafter(m, np.float32(np.inf)),
                                          lambda m: np.nextafter(m, np.float32(-np.inf)))]
    y = np.array(special + near, np.float32)
    n = 256
    y = np.concatenate([y, np.random.default_rng(bits).normal(0, 0.1, n - y.size).astype(np.float32)])
    want = np.sum(y[:, None] >= mids[None, :], axis=1)
    dev = device()
    for mode in (store.MID_SYMMETRIC, store.MID_SORTED, store.MID_ANY):
        out = torch.empty(n, dtype=torch.int32, device=dev)
        _bucketize_kernel[(1,)](torch.from_numpy(y).to(dev), torch.from_numpy(mids).to(dev), out, N=n, BITS=bits,
                     MID_MODE=mode)
        np.testing.assert_array_equal(out.cpu().numpy(), want, err_msg=f"MID_MODE {mode}")


@pytest.mark.parametrize("preset", tq_spec.PRESET_NAMES)
def test_store_nonfinite_elements_match_reference(preset):
    """NaN and +-Inf elements reach the stored fields as in the reference (and tq_jax): a value
    vector holding a NaN stores NaN scale and zero, not the range of its other elements (the
    NaN-skipping `tl.min`/`tl.max` did that: a silent wrong answer downstream); Inf gives an Inf
    range; a NaN or Inf key gives the reference's norm and codes."""
    dev = device()
    gen = torch.Generator().manual_seed(zlib.crc32(f"nonfinite/{preset}".encode()))
    d = _head_dims(preset)[0]
    t, hkv, n, p = 7, 2, 3, 4
    lay = tq_spec.layout(preset, d)
    cache = torch.randint(0, 256, (n, p, hkv, lay.slot_bytes), dtype=torch.uint8, generator=gen)
    key = torch.randn(t, hkv, d, generator=gen) * 3
    value = torch.randn(t, hkv, d, generator=gen)
    nan, inf = float("nan"), float("inf")
    value[0, 0, 5], value[1, 1, 0], value[2, 0, d - 1] = nan, inf, -inf
    value[3, 1, 2], value[3, 1, 3] = inf, -inf
    key[4, 0, 7], key[5, 1, 1], key[6, 0, 0] = nan, inf, -inf
    slots = torch.randperm(n * p, generator=gen)[:t]
    out_cache = cache.to(dev)
    tq_torch.store_kv(key.to(dev), value.to(dev), out_cache, slots.to(dev), preset=preset)
    cmp = compare_store(out_cache, key, value, cache, slots, preset=preset, field_ulps=0)
    assert cmp.ok, cmp.describe()
