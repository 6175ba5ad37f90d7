"""tq_jax under JAX transforms, with the *default* rotation and codebook (issue 12).

The default tables are cached per (preset, head_dim); caching jax arrays there
leaked the first trace's tracers into every later trace. Each scenario below
failed with `UnexpectedTracerError` before the fix: two jits with different
shapes, jit then eager, `jax.eval_shape` first, `nnx.jit` prefill then decode,
and `nnx.scan` / `lax.scan` over layers. Every case starts from a fresh table
cache so the traced call really is the first one.

Also here: `jax.grad`/`jax.jvp` raise `NotImplementedError` naming the op, the
public ``interpret=`` keyword, the lowering-platform choice under
`jax.export`, and ``store_kv(..., donate_cache=True)``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tq_jax
import tq_spec
from parity.tolerances import check_attention, compare_store
from tq_jax._src import params
from tq_jax.nnx import PagedAttention, PagedKVCache
from tqjax_cases import random_tokens

PRESET, D, HQ, HKV, PAGE = "turboquant_4bit_nc", 64, 4, 2, 4  # mse: default rotation + codebook
SLOT = tq_spec.layout(PRESET, D).slot_bytes
TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.fixture(autouse=True)
def fresh_default_tables():
    """Each test's first call builds the default tables (possibly under a trace)."""
    params._default_tables.cache_clear()
    yield
    params._default_tables.cache_clear()


def _store(k, cache, sm):
    return tq_jax.store_kv(k, k, cache, sm, preset=PRESET)


def _batch(rng, seq_len, q_len):
    """One sequence on pages [3, 1, 0]: (query, key, slots, block_table, seq_lens, qsl) as numpy."""
    table = np.array([[3, 1, 0]], np.int32)
    pos = np.arange(seq_len - q_len, seq_len)
    sm = (table[0, pos // PAGE] * PAGE + pos % PAGE).astype(np.int32)
    return (random_tokens(rng, (q_len, HQ, D)), random_tokens(rng, (q_len, HKV, D)), sm, table,
            np.array([seq_len], np.int32), np.array([0, q_len], np.int32))


def _step(q, k, cache, sm, bt, sl, qsl):
    cache = _store(k, cache, sm)
    return tq_jax.paged_attention(q, cache, bt, sl, qsl, preset=PRESET), cache


def _check_step(out, cache_before, cache_after, q, k, sm, bt, sl, qsl):
    cmp = compare_store(np.asarray(cache_after), k, k, np.asarray(cache_before), sm, preset=PRESET)
    assert cmp.ok, cmp.describe()
    res = check_attention(np.asarray(out), q, np.asarray(cache_after), bt, sl, qsl, preset=PRESET)
    assert res.ok, res.describe()


def test_two_jits_with_different_shapes():
    """The issue's repro: the second trace reused the first trace's rotation tracer."""
    cache = jnp.zeros((4, 8, 1, SLOT), jnp.uint8)
    f = lambda k, c: _store(k, c, jnp.arange(k.shape[0], dtype=jnp.int32))  # noqa: E731
    jax.jit(f)(jnp.ones((2, 1, D)), cache)
    out = jax.jit(f)(jnp.ones((3, 1, D)), cache)
    ones = np.ones((3, 1, D), np.float32)
    expect = tq_spec.reference.store_kv(ones, ones, np.zeros(cache.shape, np.uint8), np.arange(3), preset=PRESET)
    np.testing.assert_array_equal(np.asarray(out), expect)


def test_jit_then_eager_then_other_shape():
    rng = np.random.default_rng(1)
    cache = jnp.zeros((4, PAGE, HKV, SLOT), jnp.uint8)
    q, k, sm, bt, sl, qsl = _batch(rng, 6, 6)
    out, new = jax.jit(_step)(q, k, cache, sm, bt, sl, qsl)
    _check_step(out, cache, new, q, k, sm, bt, sl, qsl)
    q, k, sm, bt, sl, qsl = _batch(rng, 7, 1)
    out, newer = _step(q, k, new, sm, bt, sl, qsl)  # eager, after the jit
    _check_step(out, new, newer, q, k, sm, bt, sl, qsl)
    q, k, sm, bt, sl, qsl = _batch(rng, 9, 2)
    out, newest = jax.jit(_step)(q, k, newer, sm, bt, sl, qsl)  # a second trace, another shape
    _check_step(out, newer, newest, q, k, sm, bt, sl, qsl)


def test_eval_shape_first():
    rng = np.random.default_rng(2)
    cache = jnp.zeros((4, PAGE, HKV, SLOT), jnp.uint8)
    q, k, sm, bt, sl, qsl = _batch(rng, 5, 5)
    shapes = jax.eval_shape(_step, q, k, cache, sm, bt, sl, qsl)
    assert shapes[0].shape == q.shape and shapes[1].shape == cache.shape
    out, new = _step(q, k, cache, sm, bt, sl, qsl)
    _check_step(out, cache, new, q, k, sm, bt, sl, qsl)


def test_nnx_jit_prefill_then_decode_default_rotation():
    """tq_jax.nnx with the preset's defaults: prefill 6 tokens, then two decode steps."""
    cache = PagedKVCache(num_blocks=4, block_size=PAGE, num_kv_heads=HKV, head_dim=D, preset=PRESET)
    layer = PagedAttention(num_q_heads=HQ)
    rng = np.random.default_rng(3)

    @nnx.jit
    def step(layer, cache, q, k, sm, bt, sl, qsl):
        return layer(cache, q, k, k, sm, bt, sl, qsl)

    for seq_len, q_len in ((6, 6), (7, 1), (8, 1)):
        q, k, sm, bt, sl, qsl = _batch(rng, seq_len, q_len)
        before = np.asarray(cache.kv_cache[...])
        out = step(layer, cache, q, k, sm, bt, sl, qsl)
        _check_step(out, before, cache.kv_cache[...], q, k, sm, bt, sl, qsl)


def _layer_inputs(rng, num_layers, t):
    xs = random_tokens(rng, (t, HQ, D))
    ks = random_tokens(rng, (num_layers, t, HKV, D))
    meta = (np.arange(t, dtype=np.int32), np.array([[0, 1]], np.int32), np.array([t], np.int32),
            np.array([0, t], np.int32))
    return xs, ks, meta


def _layers_one_by_one(xs, ks, caches, meta):
    """The reference for the scans: the same layers as a Python loop of eager calls."""
    sm, bt, sl, qsl = meta
    x, new = xs, []
    for k, cache in zip(ks, caches):
        cache = _store(k, cache, sm)
        x = tq_jax.paged_attention(x, cache, bt, sl, qsl, preset=PRESET)
        new.append(cache)
    return x, jnp.stack(new)


def test_lax_scan_over_layers():
    num_layers, t = 2, 3
    xs, ks, meta = _layer_inputs(np.random.default_rng(4), num_layers, t)
    caches = jnp.zeros((num_layers, 2, PAGE, HKV, SLOT), jnp.uint8)
    sm, bt, sl, qsl = meta

    @functools.partial(jax.jit, donate_argnums=(2,))
    def forward(x, ks, caches):
        def body(x, layer):
            k, cache = layer
            cache = _store(k, cache, sm)
            return tq_jax.paged_attention(x, cache, bt, sl, qsl, preset=PRESET), cache

        return jax.lax.scan(body, x, (ks, caches))

    out, new = forward(xs, ks, jnp.array(caches))  # the scan's trace is the first call
    expect_x, expect_caches = _layers_one_by_one(xs, ks, caches, meta)
    np.testing.assert_array_equal(np.asarray(new), np.asarray(expect_caches))
    np.testing.assert_allclose(np.asarray(out), np.asarray(expect_x), rtol=1e-6, atol=1e-6)


def test_nnx_scan_over_layers():
    """Stacked `PagedKVCache`s (nnx.vmap) scanned by nnx.scan inside nnx.jit."""
    num_layers, t = 2, 3
    xs, ks, meta = _layer_inputs(np.random.default_rng(5), num_layers, t)

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(_):
        return PagedKVCache(num_blocks=2, block_size=PAGE, num_kv_heads=HKV, head_dim=D, preset=PRESET)

    caches = make(jnp.arange(num_layers))
    layer = PagedAttention(num_q_heads=HQ)
    before = caches.kv_cache[...]

    @nnx.jit
    def forward(layer, caches, x, ks):
        @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
        def body(x, cache, k):
            return layer(cache, x, k, k, *meta)

        return body(x, caches, ks)

    out = forward(layer, caches, jnp.asarray(xs), jnp.asarray(ks))  # the scan's trace is the first call
    expect_x, expect_caches = _layers_one_by_one(xs, ks, before, meta)
    np.testing.assert_array_equal(np.asarray(caches.kv_cache[...]), np.asarray(expect_caches))
    np.testing.assert_allclose(np.asarray(out), np.asarray(expect_x), rtol=1e-6, atol=1e-6)


def test_vmap_over_stacked_caches_keys_and_queries():
    """`jax.vmap` of a store then an attention step over two layers' caches, keys and queries: each layer's cache
    and output are its unbatched step's. (On sm_90 GPUs the Gluon store's case: `test_jax_gluon_store.py`.)"""
    num_layers, t = 2, 3
    xs, ks, meta = _layer_inputs(np.random.default_rng(7), num_layers, t)
    qs = np.stack([xs, xs[:, ::-1]])
    caches = jnp.zeros((num_layers, 2, PAGE, HKV, SLOT), jnp.uint8)
    out, new = jax.vmap(lambda q, k, c: _step(q, k, c, *meta))(jnp.asarray(qs), jnp.asarray(ks), caches)
    for i in range(num_layers):
        one, cache = _step(qs[i], ks[i], caches[i], *meta)
        np.testing.assert_array_equal(np.asarray(new[i]), np.asarray(cache), err_msg=f"layer {i}'s cache")
        np.testing.assert_allclose(np.asarray(out[i]), np.asarray(one), rtol=1e-6, atol=1e-6)
    _check_step(out[1], caches[1], new[1], qs[1], ks[1], *meta)


# ------------------------------------------------------------------ derivatives


def _attention_of(q, bt=None):
    rng = np.random.default_rng(6)
    _, k, sm, table, sl, qsl = _batch(rng, 5, 5)
    cache = _store(k, jnp.zeros((4, PAGE, HKV, SLOT), jnp.uint8), sm)
    return tq_jax.paged_attention(q, cache, table if bt is None else bt, sl, qsl, preset=PRESET)


@pytest.mark.parametrize("transform", ["grad", "jvp", "vjp", "jit-grad"])
def test_derivatives_raise_not_implemented(transform):
    q = jnp.asarray(random_tokens(np.random.default_rng(7), (5, HQ, D)))
    k = q[:, :HKV]
    cache = jnp.zeros((4, PAGE, HKV, SLOT), jnp.uint8)
    sm = jnp.arange(5, dtype=jnp.int32)
    cases = {
        "tq_jax.paged_attention": lambda x: _attention_of(x).sum(),
        "tq_jax.store_kv": lambda x: _store(x, cache, sm).astype(jnp.float32).sum(),
    }
    for name, f in cases.items():
        arg = q if name == "tq_jax.paged_attention" else k
        run = {
            "grad": lambda: jax.grad(f)(arg),
            "jvp": lambda: jax.jvp(f, (arg,), (arg,)),
            "vjp": lambda: jax.vjp(f, arg),
            "jit-grad": lambda: jax.jit(jax.grad(f))(arg),
        }[transform]
        with pytest.raises(NotImplementedError, match=name.replace(".", r"\.")):
            run()


def test_stop_gradient_inputs_are_not_differentiated():
    """Gradients that do not flow through the op are fine (e.g. w.r.t. a bias after it)."""
    q = jnp.asarray(random_tokens(np.random.default_rng(8), (5, HQ, D)))
    g = jax.grad(lambda b: (_attention_of(jax.lax.stop_gradient(q)) * b).sum())(jnp.float32(2.0))
    assert np.isfinite(float(g))


# ------------------------------------------------------ interpret= and lowering


def test_interpret_keyword():
    """interpret=True forces interpret mode on any backend; it is the automatic choice on CPU."""
    rng = np.random.default_rng(9)
    q, k, sm, bt, sl, qsl = _batch(rng, 5, 5)
    cache = jnp.zeros((4, PAGE, HKV, SLOT), jnp.uint8)
    auto = _store(k, cache, sm)
    forced = tq_jax.store_kv(k, k, cache, sm, preset=PRESET, interpret=True)
    cmp = compare_store(np.asarray(forced), k, k, np.asarray(cache), sm, preset=PRESET)
    assert cmp.ok, cmp.describe()
    out_auto = tq_jax.paged_attention(q, auto, bt, sl, qsl, preset=PRESET)
    out_forced = tq_jax.paged_attention(q, auto, bt, sl, qsl, preset=PRESET, interpret=True)
    res = check_attention(np.asarray(out_forced), q, np.asarray(auto), bt, sl, qsl, preset=PRESET)
    assert res.ok, res.describe()
    if jax.default_backend() == "cpu":  # the same program both ways
        np.testing.assert_array_equal(np.asarray(auto), np.asarray(forced))
        np.testing.assert_array_equal(np.asarray(out_auto), np.asarray(out_forced))
    with pytest.raises(TypeError, match="interpret"):
        tq_jax.store_kv(k, k, cache, sm, preset=PRESET, interpret="yes")
    with pytest.raises(TypeError, match="interpret"):
        tq_jax.paged_attention(q, auto, bt, sl, qsl, preset=PRESET, interpret=1)


_S = jax.ShapeDtypeStruct
_STEP_ARGS = (_S((5, HQ, D), jnp.bfloat16), _S((5, HKV, D), jnp.bfloat16), _S((4, PAGE, HKV, SLOT), jnp.uint8),
              _S((5,), jnp.int32), _S((1, 3), jnp.int32), _S((1,), jnp.int32), _S((2,), jnp.int32))


def test_export_for_cuda_from_any_host_lowers_triton():
    """Exporting for CUDA embeds the Triton kernels, never interpreter loops, whatever the host."""
    with pytest.raises(ValueError, match="custom call"):  # jax's own guard: Triton calls are not stable
        jax.export.export(jax.jit(_step), platforms=["cuda"])(*_STEP_ARGS)
    exported = jax.export.export(
        jax.jit(_step), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
    )(*_STEP_ARGS)
    text = exported.mlir_module()
    assert text.count(TRITON_CALL) == 2  # store + one attention path
    assert "stablehlo.while" not in text  # the interpreter lowers grids to while loops


def test_export_for_cpu_uses_interpret_mode_and_runs():
    exported = jax.export.export(jax.jit(_step), platforms=["cpu"])(*_STEP_ARGS)
    text = exported.mlir_module()
    assert TRITON_CALL not in text and "stablehlo.while" in text
    rng = np.random.default_rng(10)
    q, k, sm, bt, sl, qsl = _batch(rng, 5, 5)
    cpu = jax.devices("cpu")[0]
    args = jax.device_put((q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                           np.zeros((4, PAGE, HKV, SLOT), np.uint8), sm, bt, sl, qsl), cpu)
    out, cache = exported.call(*args)
    # On a GPU host too: computations on CPU arrays lower for CPU, so the automatic mode interprets.
    expect_out, expect_cache = jax.jit(_step)(*args)
    np.testing.assert_array_equal(np.asarray(cache), np.asarray(expect_cache))
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(expect_out.astype(jnp.float32)))


# ------------------------------------------------------------------- donation


def test_store_kv_donate_cache_consumes_the_input():
    rng = np.random.default_rng(11)
    _, k, sm, _, _, _ = _batch(rng, 5, 5)
    base = rng.integers(0, 256, (4, PAGE, HKV, SLOT), dtype=np.uint8)
    kept = jnp.asarray(base)
    plain = tq_jax.store_kv(k, k, kept, sm, preset=PRESET)
    assert not kept.is_deleted()  # the default copies: the caller's cache stays valid
    np.testing.assert_array_equal(np.asarray(kept), base)

    donated = jnp.asarray(base)
    pointer = donated.unsafe_buffer_pointer()
    out = tq_jax.store_kv(k, k, donated, sm, preset=PRESET, donate_cache=True)
    assert donated.is_deleted()
    assert out.unsafe_buffer_pointer() == pointer  # updated in place, no copy
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))
    cmp = compare_store(np.asarray(out), k, k, base, sm, preset=PRESET)
    assert cmp.ok, cmp.describe()


def test_donate_cache_inside_jit_is_harmless():
    """Under an outer jit the flag is moot (the outer jit's donation decides)."""
    rng = np.random.default_rng(12)
    _, k, sm, _, _, _ = _batch(rng, 5, 5)
    cache = jnp.zeros((4, PAGE, HKV, SLOT), jnp.uint8)
    f = jax.jit(lambda k, c, s: tq_jax.store_kv(k, k, c, s, preset=PRESET, donate_cache=True))
    out = f(k, cache, sm)
    assert not cache.is_deleted()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_store(k, cache, sm)))
