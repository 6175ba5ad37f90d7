"""Padding, NaN, transforms, export, donation and paging of tq_jax on a CUDA GPU (``pytest -m gpu``).

The CPU tests of the same behaviour run in interpret mode; here the Triton
lowering runs them, where float max is ``maxnumf`` (NaN-dropping), outputs are
uninitialised memory rather than NaN, and decode runs many splits. Sizes are
realistic: D 128, GQA 16/4, page 16, contexts up to 4100.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_jax_paging
import tq_jax
import tq_spec
from parity.tolerances import compare_store
from test_jax_padding_nan import check_nan_query, check_nan_sink, check_padding_rows
from tq_jax._src import params
from tqjax_cases import build_attention_case, random_tokens, skip_if_ineligible

pytestmark = pytest.mark.gpu

PATHS = tq_spec.dispatch.PATH_NAMES


def _gpu_case(name, *, preset="turboquant_4bit_nc", q_dtype="bfloat16", **kw):
    return build_attention_case(
        np.random.default_rng(zlib.crc32(name.encode())), preset=preset, head_dim=128, num_q_heads=16,
        num_kv_heads=4, block_size=16, seq_lens=[300, 0, 17, 129, 0, 4100], q_lens=[40, 0, 1, 129, 0, 1],
        q_dtype=q_dtype, **kw)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4", "bf16"])
def test_gpu_padding_rows_are_zeros(path, preset):
    check_padding_rows(_gpu_case(f"pad-{preset}", preset=preset, sliding_window=64, sinks=True), path, 37)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("q_dtype", ["bfloat16", "float32"])
def test_gpu_nan_query_rows_propagate(path, q_dtype):
    case = _gpu_case(f"nanq-{q_dtype}", q_dtype=q_dtype, logits_soft_cap=30.0)
    skip_if_ineligible(case, path)
    # prefill rows of sequences 0 and 3, the decode rows of sequences 2 and 5 (many splits)
    check_nan_query(case, path, [(3, 5), (39, 15), (40, 0), (100, 7), (170, 12)])


@pytest.mark.parametrize("path", PATHS)
def test_gpu_nan_sink_propagates(path):
    check_nan_sink(_gpu_case("nans", sinks=True, sliding_window=100), path, head=6)


def test_gpu_default_tables_under_jit_twice_then_eager():
    params._default_tables.cache_clear()
    lay = tq_spec.layout("turboquant_4bit_nc", 128)
    cache = jnp.zeros((8, 16, 2, lay.slot_bytes), jnp.uint8)

    def f(k, c):
        return tq_jax.store_kv(k, k, c, jnp.arange(k.shape[0], dtype=jnp.int32), preset="turboquant_4bit_nc")

    jax.jit(f)(jnp.ones((2, 2, 128)), cache)
    jax.jit(f)(jnp.ones((3, 2, 128)), cache)
    f(jnp.ones((4, 2, 128)), cache)


def test_gpu_grad_raises_not_implemented():
    lay = tq_spec.layout("turboquant_k8v4", 128)
    cache = jnp.zeros((8, 16, 2, lay.slot_bytes), jnp.uint8)
    k = jnp.ones((3, 2, 128))
    sm = jnp.arange(3, dtype=jnp.int32)
    with pytest.raises(NotImplementedError, match="tq_jax.store_kv"):
        jax.grad(lambda k: tq_jax.store_kv(k, k, cache, sm, preset="turboquant_k8v4").astype(jnp.float32).sum())(k)


def test_gpu_automatic_mode_is_triton_and_export_runs():
    """interpret=None compiles Triton kernels on the GPU; a CUDA export runs and matches the jit."""
    preset, d = "turboquant_4bit_nc", 128
    lay = tq_spec.layout(preset, d)
    rng = np.random.default_rng(5)

    def step(q, k, cache, sm, bt, sl, qsl):
        cache = tq_jax.store_kv(k, k, cache, sm, preset=preset)
        return tq_jax.paged_attention(q, cache, bt, sl, qsl, preset=preset), cache

    t = 20
    q, k = (jnp.asarray(random_tokens(rng, (t, h, d), "bfloat16")) for h in (8, 2))
    args = (q, k, jnp.zeros((4, 16, 2, lay.slot_bytes), jnp.uint8), jnp.arange(t, dtype=jnp.int32) + 16,
            jnp.asarray([[0, 1, 2]], jnp.int32), jnp.asarray([t + 16], jnp.int32), jnp.asarray([0, t], jnp.int32))
    text = jax.jit(step).lower(*args).as_text()
    assert "__gpu$xla.gpu.triton" in text and "stablehlo.while" not in text
    # The store of a uint8 4bit_nc cache runs the Gluon kernel where it can (jaxlib's Triton kernel call, the
    # kernel's PTX in its config); the attention here (a prefill) the Pallas kernels. Neither custom call is
    # on jax.export's list of stable ones.
    calls = [c for c in ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi") if c in text]
    exported = jax.export.export(
        jax.jit(step), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(c) for c in calls],
    )(*args)
    out, cache = exported.call(*args)
    expect_out, expect_cache = jax.jit(step)(*args)
    np.testing.assert_array_equal(np.asarray(cache), np.asarray(expect_cache))
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(expect_out.astype(jnp.float32)))


def test_gpu_store_kv_donate_cache_is_in_place():
    preset, d = "turboquant_k8v4", 128
    lay = tq_spec.layout(preset, d)
    rng = np.random.default_rng(6)
    base = rng.integers(0, 256, (64, 16, 2, lay.slot_bytes), dtype=np.uint8)
    key = random_tokens(rng, (5, 2, d), "bfloat16")
    slots = np.array([3, -1, 100, 1000, 7], np.int32)
    cache = jnp.asarray(base)
    pointer = cache.unsafe_buffer_pointer()
    out = tq_jax.store_kv(jnp.asarray(key), jnp.asarray(key), cache, slots, preset=preset, donate_cache=True)
    assert cache.is_deleted()
    assert out.unsafe_buffer_pointer() == pointer, "donate_cache=True copied the cache"
    cmp = compare_store(np.asarray(out), key, key, base, slots, preset=preset)
    assert cmp.ok, cmp.describe()


def test_gpu_store_kv_skips_slots_outside_the_cache():
    preset, d = "turboquant_3bit_nc", 128
    lay = tq_spec.layout(preset, d)
    rng = np.random.default_rng(7)
    n, p = 64, 16
    base = rng.integers(0, 256, (n, p, 2, lay.slot_bytes), dtype=np.uint8)
    key = random_tokens(rng, (6, 2, d), "float32")
    slots = np.array([n * p, 5, -7, n * p + 100, 2**31 - 1, -1], np.int32)
    out = tq_jax.store_kv(jnp.asarray(key), jnp.asarray(key), jnp.asarray(base), slots, preset=preset)
    cmp = compare_store(np.asarray(out), key[1:2], key[1:2], base, slots[1:2], preset=preset)
    assert cmp.ok, cmp.describe()


def test_gpu_paging_loops_through_the_kernels():
    """The CPU paging tests' kernel loops (prefill, prefix sharing, a jitted decode loop, window release)."""
    test_jax_paging.test_prefill_share_and_jitted_decode_loop_through_the_kernels()
    test_jax_paging.test_sliding_window_pages_are_released_and_reused()
