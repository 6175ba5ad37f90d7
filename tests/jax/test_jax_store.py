"""tq_jax.store_kv against the float64 reference (CPU: Pallas interpret mode).

Caches start as random canary bytes; parity.tolerances.compare_store checks
every written field against tq_spec and every other byte for change.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
import tq_spec
from parity.tolerances import compare_store
from tq_jax._src.params import resolve
from tq_jax._src.store import (MID_ANY, MID_SORTED, MID_SYMMETRIC, ROT_SIGNS, bucketize, store_kv_call,
                               store_operands)
from tq_spec.bits import unpack_bits
from tqjax_cases import CPU_HEAD_DIM, random_tokens

_INPUT_DTYPE = {  # cycle the input dtypes over the presets
    "turboquant_k8v4": "float32", "turboquant_4bit_nc": "bfloat16", "turboquant_k3v4_nc": "float16",
    "turboquant_3bit_nc": "float32", "bf16": "float32", "fp16": "bfloat16",
}


def _store_case(rng, preset, head_dim, *, tokens=6, heads=2, blocks=4, block_size=3, dtype="float32",
                slot_dtype=np.int32):
    lay = tq_spec.layout(preset, head_dim)
    key = random_tokens(rng, (tokens, heads, head_dim), dtype)
    value = random_tokens(rng, (tokens, heads, head_dim), dtype)
    cache = rng.integers(0, 256, (blocks, block_size, heads, lay.slot_bytes), dtype=np.uint8)
    slots = rng.permutation(blocks * block_size)[:tokens].astype(slot_dtype)
    slots[1::3] = -1  # every third token is skipped
    return key, value, cache, slots


def _assert_matches(out, key, value, cache, slots, preset, **kw):
    cmp = compare_store(out, key, value, cache, slots, preset=preset, **kw)
    assert cmp.ok, cmp.describe()
    p = tq_spec.get_preset(preset)
    # The fp8 and raw encoders are exact integer recipes: demand exact bytes so
    # the 1-ulp field tolerance cannot hide an encoder bug.
    if p.key_format == "fp8":
        assert cmp.agreement["key_fp8"] == 1.0, cmp.describe()
    if p.key_format == "raw":
        assert min(cmp.agreement.values()) == 1.0, cmp.describe()
    return cmp


@pytest.mark.parametrize("preset", tq_spec.PRESET_NAMES)
def test_store_every_preset_matches_reference(preset):
    rng = np.random.default_rng(list(tq_spec.PRESET_NAMES).index(preset))
    d = CPU_HEAD_DIM[preset]
    key, value, cache, slots = _store_case(rng, preset, d, dtype=_INPUT_DTYPE[preset],
                                           slot_dtype=np.int64 if preset.endswith("nc") else np.int32)
    out = tq_jax.store_kv(jnp.asarray(key), jnp.asarray(value), jnp.asarray(cache), jnp.asarray(slots),
                          preset=preset)
    assert out.shape == cache.shape and out.dtype == jnp.uint8
    _assert_matches(np.asarray(out), key, value, cache, slots, preset)


@pytest.mark.parametrize(
    "preset,head_dim",
    [("turboquant_k8v4", 32), ("turboquant_k8v4", 72), ("turboquant_4bit_nc", 512), ("turboquant_3bit_nc", 128),
     ("fp16", 136)],
)
def test_store_other_head_dims(preset, head_dim):
    rng = np.random.default_rng(head_dim)
    key, value, cache, slots = _store_case(rng, preset, head_dim, tokens=3, heads=1, blocks=2, block_size=2)
    out = tq_jax.store_kv(jnp.asarray(key), jnp.asarray(value), jnp.asarray(cache), jnp.asarray(slots),
                          preset=preset)
    _assert_matches(np.asarray(out), key, value, cache, slots, preset)


@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_k3v4_nc", "bf16"])
def test_store_through_word_view(preset):
    """The uint16 view used for caches of 2..4 GiB writes the same bytes."""
    rng = np.random.default_rng(7)
    d = CPU_HEAD_DIM[preset]
    key, value, cache, slots = _store_case(rng, preset, d)
    kp = resolve(preset, d)
    fn = jax.jit(functools.partial(store_kv_call, preset_name=preset, interpret=None, word_view=True))
    out = fn(jnp.asarray(key), jnp.asarray(value), jnp.asarray(cache), jnp.asarray(slots), kp.rotation,
             kp.midpoints)
    _assert_matches(np.asarray(out), key, value, cache, slots, preset)


def test_store_randomized_rotation_and_explicit_codebook():
    preset, d = "turboquant_4bit_nc", 64
    rng = np.random.default_rng(11)
    key, value, cache, slots = _store_case(rng, preset, d)
    rot = tq_spec.rotation(d, "randomized_hadamard", seed=5)
    cb = tq_spec.codebook(d, 4)
    for rotation in (rot, jnp.asarray(rot)):  # numpy data and a device array both work
        out = tq_jax.store_kv(jnp.asarray(key), jnp.asarray(value), jnp.asarray(cache), jnp.asarray(slots),
                              preset=preset, rotation=rotation, codebook=cb)
        _assert_matches(np.asarray(out), key, value, cache, slots, preset, rotation=rot, codebook=cb)
    # ... and differs from the default rotation's codes (the argument is not ignored).
    default = np.asarray(tq_jax.store_kv(jnp.asarray(key), jnp.asarray(value), jnp.asarray(cache),
                                         jnp.asarray(slots), preset=preset))
    assert not np.array_equal(default, np.asarray(out))


def test_store_all_skipped_leaves_cache_unchanged():
    preset = "turboquant_k8v4"
    rng = np.random.default_rng(3)
    key, value, cache, _ = _store_case(rng, preset, 40)
    slots = np.full(key.shape[0], -1, np.int32)
    out = tq_jax.store_kv(jnp.asarray(key), jnp.asarray(value), jnp.asarray(cache), jnp.asarray(slots),
                          preset=preset)
    np.testing.assert_array_equal(np.asarray(out), cache)


def test_store_under_jit_with_donation_chains_updates():
    """Two stores in one jitted step with the cache donated; the second sees the first."""
    preset, d = "turboquant_3bit_nc", 64
    rng = np.random.default_rng(5)
    key, value, cache, _ = _store_case(rng, preset, d)
    s1 = np.array([0, 4, -1, 7, 2, 9], np.int32)
    s2 = np.array([1, -1, 3, 5, 8, 10], np.int32)

    @functools.partial(jax.jit, donate_argnums=(2,))
    def step(k, v, c, a, b):
        c = tq_jax.store_kv(k, v, c, a, preset=preset)
        return tq_jax.store_kv(v, k, c, b, preset=preset)

    first = np.asarray(tq_jax.store_kv(jnp.asarray(key), jnp.asarray(value), jnp.asarray(cache),
                                       jnp.asarray(s1), preset=preset))
    _assert_matches(first, key, value, cache, s1, preset)
    out = np.asarray(step(jnp.asarray(key), jnp.asarray(value), jnp.asarray(cache), jnp.asarray(s1),
                          jnp.asarray(s2)))
    # The second store (values and keys swapped) on top of the first one.
    _assert_matches(out, value, key, first, s2, preset)


def test_store_zero_tokens():
    preset = "fp16"
    lay = tq_spec.layout(preset, 64)
    cache = np.random.default_rng(0).integers(0, 256, (2, 2, 1, lay.slot_bytes), dtype=np.uint8)
    kv = jnp.zeros((0, 1, 64), jnp.float16)
    out = tq_jax.store_kv(kv, kv, jnp.asarray(cache), jnp.zeros((0,), jnp.int32), preset=preset)
    np.testing.assert_array_equal(np.asarray(out), cache)


@pytest.mark.parametrize("preset", tq_spec.PRESET_NAMES)
def test_dequantize_cache_matches_reference(preset):
    """Every slot decoded back to model space: random bytes written by the store, float64 reference."""
    d = 64
    rng = np.random.default_rng(1)
    key, value, cache, slots = _store_case(rng, preset, d, tokens=6, heads=2, blocks=2, block_size=3)
    cache = np.asarray(tq_jax.store_kv(jnp.asarray(key), jnp.asarray(value), jnp.asarray(cache),
                                       jnp.asarray(slots), preset=preset))
    k, v = tq_jax.dequantize_cache(jnp.asarray(cache), preset=preset, head_dim=d)
    rk, rv = tq_spec.reference.dequantize_cache(cache, preset=preset, head_dim=d)
    assert k.dtype == v.dtype == jnp.float32 and k.shape == v.shape == rk.shape
    np.testing.assert_allclose(np.asarray(k, np.float64), rk, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(v, np.float64), rv, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- memory safety, kernel variants


@pytest.mark.parametrize("preset,word_view", [("turboquant_4bit_nc", False), ("turboquant_k8v4", True),
                                              ("turboquant_3bit_nc", True), ("bf16", False)])
def test_store_bad_slots_write_nothing(preset, word_view):
    """Slots outside [0, N*P) -- -1 padding, other negatives, N*P and beyond, int32 extremes -- write
    nothing, through the public op and through the bare kernel (its own guard), both cache views."""
    d, hkv, n, p = 64, 2, 5, 4
    rng = np.random.default_rng(17)
    lay = tq_spec.layout(preset, d)
    cache = rng.integers(0, 256, (n, p, hkv, lay.slot_bytes), dtype=np.uint8)
    good = [3, 0, n * p - 1, 9]
    slots = np.array([-1, -5, n * p, n * p + 3] + good + [2**31 - 1, -(2**31)], np.int32)
    key = random_tokens(rng, (slots.size, hkv, d))
    value = random_tokens(rng, (slots.size, hkv, d))
    ref_slots = np.where((slots >= 0) & (slots < n * p), slots, -1)
    out = tq_jax.store_kv(jnp.asarray(key), jnp.asarray(value), jnp.asarray(cache), jnp.asarray(slots),
                          preset=preset, validate=False)
    cmp = _assert_matches(np.asarray(out), key, value, cache, ref_slots, preset)
    assert cmp.slots_written == len(good)
    kp = resolve(preset, d)
    rot, form, mode = store_operands(tq_spec.layout(preset, d), kp, None, None, jnp.float32)
    fn = jax.jit(functools.partial(store_kv_call, preset_name=preset, interpret=None, word_view=word_view,
                                   rotation_form=form, midpoint_mode=mode))
    out = fn(jnp.asarray(key), jnp.asarray(value), jnp.asarray(cache), jnp.asarray(slots), rot, kp.midpoints)
    _assert_matches(np.asarray(out), key, value, cache, ref_slots, preset)


def test_store_general_rotation():
    """A rotation that is not +-c (random orthogonal, numpy) and any jax array rotation take the
    split-bf16 general path."""
    preset, d = "turboquant_4bit_nc", 64
    rng = np.random.default_rng(2)
    rot = np.linalg.qr(rng.standard_normal((d, d)))[0].astype(np.float32)
    key, value, cache, slots = _store_case(rng, preset, d, tokens=9, dtype="bfloat16")
    for rotation, want in ((rot, rot), (jnp.asarray(tq_spec.rotation(d)), None)):
        out = tq_jax.store_kv(jnp.asarray(key), jnp.asarray(value), jnp.asarray(cache), jnp.asarray(slots),
                              preset=preset, rotation=rotation)
        _assert_matches(np.asarray(out), key, value, cache, slots, preset, rotation=want)


@pytest.mark.parametrize("kind", ["asymmetric", "symmetric_exact"])
def test_store_other_codebooks(kind):
    """Codebooks the symmetric search does not apply to (asymmetric) and another symmetric one."""
    preset, d = "turboquant_k3v4_nc", 64
    if kind == "symmetric_exact":
        cb = tq_spec.codebook(d, 3, flavor="exact")
    else:
        c = np.sort(np.random.default_rng(4).normal(0.05, 0.12, 8)).astype(np.float32)
        cb = tq_spec.Codebook(d, 3, "custom", c, ((c[:-1] + c[1:]) / np.float32(2)).astype(np.float32))
    rng = np.random.default_rng(6)
    key, value, cache, slots = _store_case(rng, preset, d, tokens=8, dtype="bfloat16")
    out = tq_jax.store_kv(jnp.asarray(key), jnp.asarray(value), jnp.asarray(cache), jnp.asarray(slots),
                          preset=preset, codebook=cb)
    _assert_matches(np.asarray(out), key, value, cache, slots, preset, codebook=cb)


def test_store_value_codes_are_the_fp32_chain():
    """Value codes and fp16 fields equal, bit for bit, ``floor(RN(RN(RN(v - lo) / scale) + 0.5))``
    in IEEE fp32 (what the kernel computes on every backend), on bf16 data full of exact ties."""
    preset, d = "turboquant_k8v4", 128
    lay = tq_spec.layout(preset, d)
    rng = np.random.default_rng(8)
    t, hkv = 32, 2
    value = (rng.integers(-24, 25, (t, hkv, d)).astype(np.float32) / 8).astype(jnp.bfloat16)
    value[::5] = rng.standard_normal(value[::5].shape).astype(jnp.bfloat16)
    key = rng.standard_normal((t, hkv, d)).astype(jnp.bfloat16)
    cache = np.zeros((t // 4, 4, hkv, lay.slot_bytes), np.uint8)
    got = np.asarray(tq_jax.store_kv(jnp.asarray(key), jnp.asarray(value), jnp.asarray(cache),
                                     jnp.arange(t, dtype=jnp.int32), preset=preset)).reshape(t, hkv, -1)
    v = value.astype(np.float32)
    lo, hi = v.min(-1, keepdims=True), v.max(-1, keepdims=True)
    scale = np.maximum((hi - lo) / np.float32(15), np.float32(1e-8)).astype(np.float32)
    codes = np.floor(((v - lo) / scale).astype(np.float32) + np.float32(0.5)).astype(np.int64)
    np.testing.assert_array_equal(unpack_bits(got[..., lay.value_offset:lay.value_offset + lay.value_bytes], 4, d),
                                  np.clip(codes, 0, 15))
    np.testing.assert_array_equal(got[..., lay.value_scale_offset:lay.value_scale_offset + 2].view(np.float16)[..., 0],
                                  scale[..., 0].astype(np.float16))
    np.testing.assert_array_equal(got[..., lay.value_zero_offset:lay.value_zero_offset + 2].view(np.float16)[..., 0],
                                  lo[..., 0].astype(np.float16))


@pytest.mark.parametrize("mode", [MID_SYMMETRIC, MID_SORTED, MID_ANY])
def test_store_every_midpoint_search_and_many_tiles(mode):
    """Each code search, and more row tiles than programs (the tile loop and its prefetch)."""
    preset, d = "turboquant_4bit_nc", 64
    rng = np.random.default_rng(9)
    key, value, cache, slots = _store_case(rng, preset, d, tokens=40, heads=3, blocks=20, block_size=4,
                                           dtype="bfloat16")
    kp = resolve(preset, d)
    rot, form, _ = store_operands(tq_spec.layout(preset, d), kp, None, None, jnp.bfloat16)
    fn = jax.jit(functools.partial(store_kv_call, preset_name=preset, interpret=None, rotation_form=form,
                                   midpoint_mode=mode))
    out = fn(jnp.asarray(key), jnp.asarray(value), jnp.asarray(cache), jnp.asarray(slots), rot, kp.midpoints)
    _assert_matches(np.asarray(out), key, value, cache, slots, preset)


@pytest.mark.parametrize("bits", [3, 4])
def test_bucketize_is_the_exact_count(bits):
    """`bucketize` (all three searches) equals ``#{j : y >= m_j}`` exactly: on every midpoint, one
    ulp either side, at +-0, +-inf, NaN and at random. (Not at subnormals: XLA on the CPU flushes
    them to zero, so interpret mode compares -1e-45 as -0; the GPU does not flush.)"""
    mids = tq_spec.codebook(128, bits).midpoints.astype(np.float32)
    special = [np.float32(x) for x in (0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30, -1e-30, 3.0, -3.0)]
    near = [f(m) for m in mids if m != 0 for f in (lambda m: m, lambda m: np.nextafter(m, np.float32(np.inf)),
                                                    lambda m: np.nextafter(m, np.float32(-np.inf)))]
    y = np.array(special + near, np.float32)
    y = np.concatenate([y, np.random.default_rng(bits).normal(0, 0.1, 256 - y.size).astype(np.float32)])
    want = np.sum(y[:, None] >= mids[None, :], axis=1)
    for mode in (MID_SYMMETRIC, MID_SORTED, MID_ANY):
        got = jax.jit(lambda yy: bucketize(yy, [jnp.float32(m) for m in mids], bits, mode))(jnp.asarray(y))
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"mode {mode}")


@pytest.mark.parametrize("preset,dtype", [("turboquant_4bit_nc", jnp.bfloat16), ("turboquant_k3v4_nc", jnp.float16),
                                          ("turboquant_3bit_nc", jnp.float32)])
def test_store_sign_path_lowers_to_triton(preset, dtype):
    """The sign-rotation / symmetric-search kernel (what `store_kv` runs by default) lowers for CUDA
    with tensor-core dots (the shared lowering test drives the general path through `store_kv_call`)."""
    from jax._src.pallas.triton import lowering as triton_lowering

    modules = []
    original = triton_lowering.lower_jaxpr_to_triton_module

    def verified(*args, **kwargs):
        result = original(*args, **kwargs)
        assert result.module.operation.verify()
        modules.append(result.module.operation.get_asm())
        return result

    d = 128
    lay = tq_spec.layout(preset, d)
    kp = resolve(preset, d)
    rot, form, mode = store_operands(lay, kp, None, None, dtype)
    assert form[0] == ROT_SIGNS and mode == MID_SYMMETRIC
    fn = functools.partial(store_kv_call, preset_name=preset, interpret=False, rotation_form=form, midpoint_mode=mode)
    S = jax.ShapeDtypeStruct
    triton_lowering.lower_jaxpr_to_triton_module = verified
    try:
        jax.jit(fn).trace(S((300, 4, d), dtype), S((300, 4, d), dtype), S((20, 16, 4, lay.slot_bytes), jnp.uint8),
                          S((300,), jnp.int32), S(rot.shape, rot.dtype), S((16,), jnp.float32)
                          ).lower(lowering_platforms=("cuda",))
    finally:
        triton_lowering.lower_jaxpr_to_triton_module = original
    (asm,) = modules
    assert "tt.dot" in asm and "scf.for" in asm and "div.rn.f32" in asm and "fma.rn.f32" in asm


@pytest.mark.parametrize("preset", tq_spec.PRESET_NAMES)
def test_store_nonfinite_elements_match_reference(preset):
    """NaN and +-Inf elements reach the stored fields as in the reference (and tq_torch): a value
    vector holding a NaN stores NaN scale and zero, Inf gives an Inf range, and a NaN or Inf key
    gives the reference's norm and codes."""
    rng = np.random.default_rng(7 + list(tq_spec.PRESET_NAMES).index(preset))
    d = CPU_HEAD_DIM[preset]
    t, hkv, n, p = 7, 2, 3, 4
    lay = tq_spec.layout(preset, d)
    cache = rng.integers(0, 256, (n, p, hkv, lay.slot_bytes), dtype=np.uint8)
    key = (rng.standard_normal((t, hkv, d)) * 3).astype(np.float32)
    value = rng.standard_normal((t, hkv, d)).astype(np.float32)
    value[0, 0, 5], value[1, 1, 0], value[2, 0, d - 1] = np.nan, np.inf, -np.inf
    value[3, 1, 2], value[3, 1, 3] = np.inf, -np.inf
    key[4, 0, 7], key[5, 1, 1], key[6, 0, 0] = np.nan, np.inf, -np.inf
    slots = rng.permutation(n * p)[:t].astype(np.int32)
    out = tq_jax.store_kv(jnp.asarray(key), jnp.asarray(value), jnp.asarray(cache), jnp.asarray(slots),
                          preset=preset)
    cmp = compare_store(np.asarray(out), key, value, cache, slots, preset=preset, field_ulps=0)
    assert cmp.ok, cmp.describe()
