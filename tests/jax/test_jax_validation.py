"""tq_jax rejects bad input with errors that name the argument (DESIGN.md section 6)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
import tq_spec
from parity.tolerances import compare_store


def _store_args(preset="turboquant_k8v4", d=64, t=3, h=2, n=4, p=4):
    lay = tq_spec.layout(preset, d)
    kv = jnp.ones((t, h, d), jnp.float32)
    return kv, kv, jnp.zeros((n, p, h, lay.slot_bytes), jnp.uint8), jnp.zeros((t,), jnp.int32)


def _attn_args(preset="turboquant_k8v4", d=64, t=3, hq=4, hkv=2, n=4, p=4, b=2):
    lay = tq_spec.layout(preset, d)
    return (jnp.ones((t, hq, d), jnp.bfloat16), jnp.zeros((n, p, hkv, lay.slot_bytes), jnp.uint8),
            jnp.zeros((b, 2), jnp.int32), jnp.full((b,), 3, jnp.int32), jnp.asarray([0, 1, 3], jnp.int32))


@pytest.mark.parametrize(
    "mutate,exc,name",
    [
        (lambda a: (a[0].astype(jnp.int32),) + a[1:], TypeError, "key"),
        (lambda a: (a[0], a[1][:, :1]) + a[2:], ValueError, "value"),
        (lambda a: a[:2] + (a[2][..., :-2],) + a[3:], ValueError, "kv_cache"),
        (lambda a: a[:2] + (a[2].astype(jnp.int8),) + a[3:], TypeError, "kv_cache"),
        (lambda a: a[:3] + (a[3].astype(jnp.float32),), TypeError, "slot_mapping"),
        (lambda a: a[:3] + (a[3][:2],), ValueError, "slot_mapping"),
    ],
)
def test_store_kv_rejects_bad_arguments(mutate, exc, name):
    with pytest.raises(exc, match=name):
        tq_jax.store_kv(*mutate(_store_args()), preset="turboquant_k8v4")


def test_store_kv_rejects_bad_preset_head_dim_and_params():
    with pytest.raises(ValueError, match="preset"):
        tq_jax.store_kv(*_store_args(), preset="turboquant_2bit")
    kv = jnp.ones((2, 1, 96), jnp.float32)
    lay = tq_spec.layout("turboquant_k8v4", 96)
    with pytest.raises(ValueError, match="head_dim"):  # mse presets need a power of two
        tq_jax.store_kv(kv, kv, jnp.zeros((2, 2, 1, lay.slot_bytes), jnp.uint8), jnp.zeros((2,), jnp.int32),
                        preset="turboquant_4bit_nc")
    with pytest.raises(ValueError, match="rotation"):
        tq_jax.store_kv(*_store_args(), preset="turboquant_k8v4", rotation=np.eye(64, dtype=np.float32))
    args = _store_args("turboquant_4bit_nc")
    with pytest.raises(ValueError, match="rotation"):
        tq_jax.store_kv(*args, preset="turboquant_4bit_nc", rotation=jnp.eye(32))
    with pytest.raises(ValueError, match="codebook"):
        tq_jax.store_kv(*args, preset="turboquant_4bit_nc", codebook=tq_spec.codebook(64, 3))


@pytest.mark.parametrize(
    "mutate,kwargs,exc,name",
    [
        (lambda a: (a[0].astype(jnp.int32),) + a[1:], {}, TypeError, "query"),
        (lambda a: (a[0][:, :3],) + a[1:], {}, ValueError, "query"),  # Hq % Hkv != 0
        (lambda a: a[:2] + (a[2].astype(jnp.float32),) + a[3:], {}, TypeError,
         "block_table"),
        (lambda a: a[:3] + (a[3][:1],) + a[4:], {}, ValueError, "seq_lens"),
        (lambda a: a[:4] + (a[4][:2],), {}, ValueError, "query_start_loc"),
        (lambda a: a, {"sliding_window": 0}, ValueError, "sliding_window"),
        (lambda a: a, {"logits_soft_cap": -1.0}, ValueError, "logits_soft_cap"),
        (lambda a: a, {"sinks": jnp.zeros((3,), jnp.float32)}, ValueError, "sinks"),
        (lambda a: a, {"sinks": jnp.zeros((4,), jnp.bfloat16)}, TypeError, "sinks"),
        (lambda a: a, {"path": "prefill"}, ValueError, "path"),
    ],
)
def test_paged_attention_rejects_bad_arguments(mutate, kwargs, exc, name):
    with pytest.raises(exc, match=name):
        tq_jax.paged_attention(*mutate(_attn_args()), preset="turboquant_k8v4", **kwargs)


def test_paged_attention_remembered_call_still_checks_what_varies():
    """An eager call whose static facts passed before skips those checks (host time); it gives the
    same output, and a call that differs in shape, dtype, a static argument, or asks for value
    validation is still checked."""
    args = _attn_args()
    first = tq_jax.paged_attention(*args, preset="turboquant_k8v4")
    again = tq_jax.paged_attention(*args, preset="turboquant_k8v4")
    np.testing.assert_array_equal(np.asarray(again, np.float32), np.asarray(first, np.float32))
    with pytest.raises(TypeError, match="block_table"):
        tq_jax.paged_attention(*args[:2], args[2].astype(jnp.float32), *args[3:], preset="turboquant_k8v4")
    with pytest.raises(ValueError, match="sliding_window"):
        tq_jax.paged_attention(*args, preset="turboquant_k8v4", sliding_window=0)
    with pytest.raises(TypeError, match="sliding_window"):
        tq_jax.paged_attention(*args, preset="turboquant_k8v4", sliding_window=True)
    bad_lens = jnp.asarray([3, 99], jnp.int32)
    with pytest.raises(ValueError, match="seq_lens"):
        tq_jax.paged_attention(*args[:3], bad_lens, args[4], preset="turboquant_k8v4", validate=True)
    with pytest.raises(TypeError, match="validate"):
        tq_jax.paged_attention(*args, preset="turboquant_k8v4", validate="yes")
    with pytest.raises(TypeError, match="query"):  # the arrays are checked before `validate`
        tq_jax.paged_attention(args[0].astype(jnp.int32), *args[1:], preset="turboquant_k8v4", validate="yes")


def test_dequantize_cache_rejects_wrong_slot_size():
    with pytest.raises(ValueError, match="kv_cache"):
        tq_jax.dequantize_cache(jnp.zeros((2, 2, 1, 10), jnp.uint8), preset="fp16", head_dim=64)


def test_dispatch_table_is_tq_spec_s():
    assert tq_jax.PATHS is tq_spec.dispatch.PATHS
    problem = tq_spec.dispatch.DispatchProblem(4, 4, 8, 2, 128, 16, "bf16")
    assert tq_jax.select_path(problem) == "decode"


# ------------------------------------------------------------ foreign arrays and host metadata

_STORE_NAMES = ("key", "value", "kv_cache", "slot_mapping")
_ATTN_NAMES = ("query", "kv_cache", "block_table", "seq_lens", "query_start_loc")


@pytest.mark.parametrize("index", range(4), ids=_STORE_NAMES)
def test_store_kv_rejects_torch_tensors(index):
    torch = pytest.importorskip("torch")
    args = list(_store_args())
    args[index] = torch.from_numpy(np.asarray(args[index]).copy())
    with pytest.raises(TypeError, match=f"^{_STORE_NAMES[index]}: .*torch"):
        tq_jax.store_kv(*args, preset="turboquant_k8v4")


@pytest.mark.parametrize("index", range(6), ids=_ATTN_NAMES + ("sinks",))
def test_paged_attention_rejects_torch_tensors(index):
    torch = pytest.importorskip("torch")
    args = [np.asarray(a) for a in _attn_args()]
    sinks = np.zeros(4, np.float32)
    if index == 5:
        sinks = torch.from_numpy(sinks)
    else:
        args[index] = torch.from_numpy(args[index].astype(np.float32 if index == 0 else args[index].dtype))
    name = (_ATTN_NAMES + ("sinks",))[index]
    with pytest.raises(TypeError, match=f"^{name}: .*torch"):
        tq_jax.paged_attention(*args, preset="turboquant_k8v4", sinks=sinks)


def test_lists_are_rejected_with_the_argument_name():
    args = list(_store_args())
    args[3] = [0, 1, 2]
    with pytest.raises(TypeError, match="^slot_mapping: expected a jax.Array or numpy.ndarray, got builtins.list"):
        tq_jax.store_kv(*args, preset="turboquant_k8v4")


def _small_attention(preset="turboquant_4bit_nc", d=64):
    """A valid batch as numpy arrays: decode + prefill over a stored cache."""
    lay = tq_spec.layout(preset, d)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((7, 2, d)).astype(np.float32)
    slots = np.array([8, 9, 10, 11, 4, 5, 6], np.int64)
    cache = tq_spec.reference.store_kv(k, k, np.zeros((4, 4, 2, lay.slot_bytes), np.uint8), slots, preset=preset)
    q = rng.standard_normal((4, 4, d)).astype(np.float32)
    return q, cache, np.array([[2, 0], [1, 3]], np.int64), np.array([4, 3], np.int64), np.array([0, 1, 4], np.int64)


def test_numpy_int64_metadata_is_accepted():
    """Host int64 metadata (numpy's default) converts to int32 losslessly; same result as int32."""
    q, cache, bt, sl, qsl = _small_attention()
    out64 = tq_jax.paged_attention(q, cache, bt, sl, qsl, preset="turboquant_4bit_nc")
    out32 = tq_jax.paged_attention(q, cache, *(a.astype(np.int32) for a in (bt, sl, qsl)), preset="turboquant_4bit_nc")
    np.testing.assert_array_equal(np.asarray(out64), np.asarray(out32))
    k = np.ones((2, 2, 64), np.float32)
    new64 = tq_jax.store_kv(k, k, cache, np.array([0, -1], np.int64), preset="turboquant_4bit_nc")
    new32 = tq_jax.store_kv(k, k, cache, np.array([0, -1], np.int32), preset="turboquant_4bit_nc")
    np.testing.assert_array_equal(np.asarray(new64), np.asarray(new32))


@pytest.mark.parametrize("index,name", [(2, "block_table"), (3, "seq_lens"), (4, "query_start_loc")])
def test_numpy_int64_metadata_beyond_int32_is_a_clear_error(index, name):
    args = list(_small_attention())
    args[index] = args[index].copy()
    args[index].flat[-1] = 2**40
    with pytest.raises(ValueError, match=f"^{name}: expected values that fit in int32, got {2**40}"):
        tq_jax.paged_attention(*args, preset="turboquant_4bit_nc")
    k = np.ones((2, 2, 64), np.float32)
    with pytest.raises(ValueError, match="^slot_mapping: expected values that fit in int32"):
        tq_jax.store_kv(k, k, args[1], np.array([0, -2**40], np.int64), preset="turboquant_4bit_nc")


def test_store_kv_skips_slots_outside_the_cache():
    """Memory safety: slots < -1 or >= N * P write nothing (no wrap into another slot)."""
    lay = tq_spec.layout("turboquant_k8v4", 64)
    n, p = 4, 4
    canary = np.random.default_rng(1).integers(0, 256, (n, p, 2, lay.slot_bytes), dtype=np.uint8)
    k = np.random.default_rng(2).standard_normal((5, 2, 64)).astype(np.float32)
    slots = np.array([n * p, 3, -5, n * p + 3, 2**31 - 1], np.int32)
    out = np.asarray(tq_jax.store_kv(k, k, canary, slots, preset="turboquant_k8v4"))
    cmp = compare_store(out, k[1:2], k[1:2], canary, slots[1:2], preset="turboquant_k8v4")
    assert cmp.ok, cmp.describe()
