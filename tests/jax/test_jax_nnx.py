"""tq_jax.nnx modules: a prefill step then a decode step through nnx.jit, against the reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

import tq_spec
from parity.tolerances import check_attention, compare_store
from tq_jax.nnx import PagedAttention, PagedKVCache
from tqjax_cases import random_tokens


def test_prefill_then_decode_through_nnx_jit():
    preset, d, hq, hkv, page = "turboquant_k3v4_nc", 64, 4, 2, 4
    rot = tq_spec.rotation(d, "randomized_hadamard", seed=1)
    cache = PagedKVCache(num_blocks=6, block_size=page, num_kv_heads=hkv, head_dim=d, preset=preset, rotation=rot)
    layer = PagedAttention(num_q_heads=hq, sliding_window=6, use_sinks=True)
    layer.sinks[...] = jnp.asarray(np.linspace(-1, 1, hq, dtype=np.float32))
    rng = np.random.default_rng(0)
    table = np.array([[4, 1, 3]], np.int32)

    @nnx.jit
    def step(layer, cache, q, k, v, sm, bt, sl, qsl):
        return layer(cache, q, k, v, sm, bt, sl, qsl)

    before = np.asarray(cache.kv_cache[...])
    steps = [(0, 7), (7, 8)]  # prefill 7 tokens, then decode 1
    for start, stop in steps:
        n = stop - start
        k = random_tokens(rng, (n, hkv, d), "bfloat16")
        v = random_tokens(rng, (n, hkv, d), "bfloat16")
        q = random_tokens(rng, (n, hq, d), "bfloat16")
        pos = np.arange(start, stop)
        sm = (table[0, pos // page] * page + pos % page).astype(np.int32)
        sl = np.array([stop], np.int32)
        qsl = np.array([0, n], np.int32)
        out = step(layer, cache, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(sm),
                   jnp.asarray(table), jnp.asarray(sl), jnp.asarray(qsl))
        after = np.asarray(cache.kv_cache[...])
        cmp = compare_store(after, k, v, before, sm, preset=preset, rotation=rot)
        assert cmp.ok, cmp.describe()
        res = check_attention(np.asarray(out.astype(jnp.float32)), q, after, table, sl, qsl, preset=preset,
                              sliding_window=6, sinks=np.asarray(layer.sinks[...]), rotation=rot)
        assert res.ok, res.describe()
        before = after
