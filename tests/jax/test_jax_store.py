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
from tq_jax._src.store import store_kv_call
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
