"""tq_jax rejects bad input with errors that name the argument (DESIGN.md section 6)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
import tq_spec


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


def test_dequantize_cache_rejects_wrong_slot_size():
    with pytest.raises(ValueError, match="kv_cache"):
        tq_jax.dequantize_cache(jnp.zeros((2, 2, 1, 10), jnp.uint8), preset="fp16", head_dim=64)


def test_dispatch_table_is_tq_spec_s():
    assert tq_jax.PATHS is tq_spec.dispatch.PATHS
    problem = tq_spec.dispatch.DispatchProblem(4, 4, 8, 2, 128, 16, "bf16")
    assert tq_jax.select_path(problem) == "decode"
