"""tq_jax's store on the shared Gluon kernel (`tq_jax._src.gluon_store`, `tq_gluon.store`).

On the CPU: which calls it declines. On an sm_90 GPU (``pytest -m gpu``): `tq_jax.store_kv` with the
preset's default tables runs it, writes the float64 reference's bytes (exact fields) into canary-filled
caches, skips bad slots, updates a donated cache in place, and agrees with the Pallas store when it is off.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import tq_jax
from parity.tolerances import compare_store
from tq_gluon import store as shared
from tq_jax._src import gluon_store
from tqjax_cases import CountingTraces, needs_gluon

PRESETS = shared.PRESETS


def test_the_store_kernel_declines_what_it_does_not_write():
    common = dict(head_dim=128, num_slots=1024, default_tables=True, interpret=False)
    assert "interpreter" in gluon_store.ineligible("turboquant_4bit_nc", key_dtype=jnp.bfloat16,
                                                  value_dtype=jnp.bfloat16, **dict(common, interpret=True))
    assert "bfloat16" in gluon_store.ineligible("turboquant_4bit_nc", key_dtype=jnp.float16,
                                                value_dtype=jnp.float16, **common)
    assert "default" in gluon_store.ineligible("turboquant_3bit_nc", key_dtype=jnp.bfloat16,
                                               value_dtype=jnp.bfloat16, **dict(common, default_tables=False))
    assert "slots" in gluon_store.ineligible("turboquant_k8v4", key_dtype=jnp.bfloat16, value_dtype=jnp.bfloat16,
                                             **common)
    assert "D=128" in gluon_store.ineligible("turboquant_4bit_nc", key_dtype=jnp.bfloat16,
                                             value_dtype=jnp.bfloat16, **dict(common, head_dim=256))


def _inputs(preset, t, hkv, n, p, seed):
    """A canary-filled cache, bf16 K/V, and slots: a permutation of the cache's with -1 and out-of-range ones."""
    import tq_spec

    rng = np.random.default_rng(zlib.crc32(f"{preset}/{t}/{hkv}/{n}/{p}/{seed}".encode()))
    lay = tq_spec.layout(preset, 128)
    cache = rng.integers(0, 256, (n, p, hkv, lay.slot_bytes), dtype=np.uint8)
    key = (rng.standard_normal((t, hkv, 128)) * 5).astype(ml_dtypes.bfloat16)
    value = (rng.standard_normal((t, hkv, 128)) + 0.5).astype(ml_dtypes.bfloat16)
    slots = rng.permutation(n * p)[:t].astype(np.int32)
    slots[::7] = -1
    slots[3::11] = n * p + 5
    return cache, key, value, slots


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("t,hkv,n,p", [(1, 8, 4, 16), (63, 2, 40, 16), (1000, 4, 80, 48), (77, 3, 300, 1),
                                       (5000, 8, 400, 16)])
def test_gpu_store_kv_takes_the_gluon_store_and_writes_the_reference_bytes(preset, t, hkv, n, p, monkeypatch):
    cache, key, value, slots = _inputs(preset, t, hkv, n, p, 0)
    counting = CountingTraces(monkeypatch, gluon_store, "store")
    got = tq_jax.store_kv(jnp.asarray(key), jnp.asarray(value), jnp.asarray(cache), jnp.asarray(slots),
                          preset=preset)
    assert counting.calls == 1
    in_cache = np.where(slots < n * p, slots, -1)  # (the comparison reads slots in the cache only)
    cmp = compare_store(np.asarray(got), key.astype(np.float32), value.astype(np.float32), cache, in_cache,
                        preset=preset, field_ulps=0)
    assert cmp.ok, cmp.describe()
    monkeypatch.setattr(shared, "ENABLED", False)
    counting = CountingTraces(monkeypatch, gluon_store, "store")
    pallas = tq_jax.store_kv(jnp.asarray(key), jnp.asarray(value), jnp.asarray(cache), jnp.asarray(slots),
                             preset=preset)
    assert counting.calls == 0
    # Same bytes as the Pallas store but for codes at bucket boundaries (fp32 sums in another order).
    differ = int((np.asarray(got) != np.asarray(pallas)).sum())
    assert differ <= max(2, cache.size // 20000), f"{differ} bytes differ from the Pallas store"


@pytest.mark.gpu
@needs_gluon
def test_gpu_gluon_store_bad_slots_write_nothing_and_donation_updates_in_place(monkeypatch):
    preset = "turboquant_4bit_nc"
    cache, key, value, _ = _inputs(preset, 64, 8, 4, 16, 2)
    counting = CountingTraces(monkeypatch, gluon_store, "store")
    for slots in (np.full(64, -1), np.arange(64) + 64, np.arange(64) - 2**20):
        got = tq_jax.store_kv(jnp.asarray(key), jnp.asarray(value), jnp.asarray(cache),
                              jnp.asarray(slots.astype(np.int32)), preset=preset)
        assert np.array_equal(np.asarray(got), cache), f"slots {slots[:3].tolist()}...: bytes changed"
    assert counting.calls >= 1
    slots = np.arange(64, dtype=np.int32)
    donated = jnp.asarray(cache)
    pointer = donated.unsafe_buffer_pointer()
    out = tq_jax.store_kv(jnp.asarray(key), jnp.asarray(value), donated, jnp.asarray(slots), preset=preset,
                          donate_cache=True)
    assert out.unsafe_buffer_pointer() == pointer
    cmp = compare_store(np.asarray(out), key.astype(np.float32), value.astype(np.float32), cache, slots,
                        preset=preset, field_ulps=0)
    assert cmp.ok, cmp.describe()


def _per_layer_check(got, caches, key, value, slots, preset):
    """Each layer ``got[i]`` is the unbatched store into ``caches[i]`` byte for byte, and wrote something."""
    for i in range(len(caches)):
        one = tq_jax.store_kv(jnp.asarray(key), jnp.asarray(value), jnp.asarray(caches[i]), jnp.asarray(slots),
                              preset=preset)
        assert np.array_equal(np.asarray(got[i]), np.asarray(one)), f"cache {i}: differs from its unbatched store"
        assert not np.array_equal(np.asarray(got[i]), caches[i]), f"cache {i}: nothing written"


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("kernel", ["gluon", "pallas"])
def test_gpu_vmap_over_caches_runs_the_store_per_element(kernel, monkeypatch):
    """`jax.vmap` of `tq_jax.store_kv` over a stack of caches (the layers of a model): the Gluon kernel once per
    cache (or the Pallas store, switched off), each result the unbatched call's bytes. Before the launcher's
    barriers (`launcher._fenced_launch`), XLA's dynamic-slice fusion left the Gluon store's results unwritten."""
    preset = "turboquant_4bit_nc"
    cache, key, value, slots = _inputs(preset, 100, 8, 12, 16, 3)
    caches = np.stack([cache, cache[::-1].copy()])
    if kernel == "pallas":
        monkeypatch.setattr(shared, "ENABLED", False)
    counting = CountingTraces(monkeypatch, gluon_store, "store")
    batched = jax.vmap(lambda c: tq_jax.store_kv(jnp.asarray(key), jnp.asarray(value), c, jnp.asarray(slots),
                                                 preset=preset))(jnp.asarray(caches))
    assert counting.calls == (1 if kernel == "gluon" else 0)
    _per_layer_check(batched, caches, key, value, slots, preset)
    if kernel == "gluon":  # (the Pallas store's bytes against the reference: test_jax_store.py)
        in_cache = np.where(slots < 12 * 16, slots, -1)
        cmp = compare_store(np.asarray(batched[1]), key.astype(np.float32), value.astype(np.float32), caches[1],
                            in_cache, preset=preset, field_ulps=0)
        assert cmp.ok, cmp.describe()


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("kernel", ["gluon", "pallas"])
def test_gpu_scan_over_layer_caches_stores_into_every_layer(kernel, monkeypatch):
    """`lax.scan` of `tq_jax.store_kv` over stacked layer caches, as `flax.linen.scan` runs a model's layers: each
    layer's result is its unbatched store's bytes (the dynamic-slice fusion case of the vmap test above)."""
    preset = "turboquant_4bit_nc"
    cache, key, value, slots = _inputs(preset, 100, 8, 12, 16, 4)
    caches = np.stack([cache, cache[::-1].copy(), cache ^ np.uint8(0x5A)])
    if kernel == "pallas":
        monkeypatch.setattr(shared, "ENABLED", False)
    counting = CountingTraces(monkeypatch, gluon_store, "store")

    def layer(carry, c):
        return carry, tq_jax.store_kv(jnp.asarray(key), jnp.asarray(value), c, jnp.asarray(slots), preset=preset)

    _, got = jax.jit(lambda cs: jax.lax.scan(layer, 0, cs))(jnp.asarray(caches))
    assert counting.calls == (1 if kernel == "gluon" else 0)
    _per_layer_check(got, caches, key, value, slots, preset)
