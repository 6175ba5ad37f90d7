"""The query rotation of `tq_jax._src.attention` against float64 numpy (any backend)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import tq_spec
from tq_jax._src.attention import query_rotation, rotate_query
from tq_jax._src.params import resolve

_PRESET = tq_spec.get_preset("turboquant_4bit_nc")


def _query(t, hq, d, dtype, seed):
    rng = np.random.default_rng(seed)
    # Magnitudes over several binades, both signs.
    q = rng.standard_normal((t, hq, d)) * np.exp2(rng.integers(-3, 4, (t, hq, d)))
    return jnp.asarray(q.astype(np.float32)).astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("d", [64, 128])
def test_default_rotation_is_the_rounded_exact_product(dtype, d):
    # tq_spec's Hadamard rotation is c * (+-1): the sign path must give float64 Pi @ q rounded
    # to fp32, then to the query's dtype, bit for bit.
    q = _query(5, 3, d, dtype, seed=d)
    rot, scale = query_rotation(_PRESET, d, None, resolve(_PRESET, d).rotation, dtype)
    assert scale is not None and rot.dtype == jnp.dtype(dtype)
    got = rotate_query(q, rot, scale)
    assert got.dtype == jnp.dtype(dtype) and got.shape == q.shape
    want = (np.asarray(q.astype(jnp.float32), np.float64) @ tq_spec.rotation(d).astype(np.float64).T)
    want = jnp.asarray(want.astype(np.float32)).astype(dtype)
    assert np.array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


def test_other_rotations_and_fp32_queries_take_the_fp32_einsum():
    d = 64
    default = resolve(_PRESET, d).rotation
    # fp32 query: no sign path (its products with bf16 signs would not be exact).
    assert query_rotation(_PRESET, d, None, default, jnp.float32) == (default, None)
    # A rotation that is not +-c, and a jax array whose values a trace may not see.
    rng = np.random.default_rng(3)
    general = np.linalg.qr(rng.standard_normal((d, d)))[0].astype(np.float32)
    rot = resolve(_PRESET, d, general).rotation
    assert query_rotation(_PRESET, d, general, rot, jnp.bfloat16)[1] is None
    assert query_rotation(_PRESET, d, jnp.asarray(general), rot, jnp.bfloat16)[1] is None
    # A numpy rotation of the +-c form (tq_spec's randomized Hadamard) takes the sign path.
    signed = tq_spec.rotation(d, "randomized_hadamard")
    rot_s, scale = query_rotation(_PRESET, d, signed, resolve(_PRESET, d, signed).rotation, jnp.float16)
    assert scale == pytest.approx(abs(float(signed[0, 0])))
    q = _query(2, 2, d, jnp.float16, seed=5)
    want = np.asarray(q.astype(jnp.float32), np.float64) @ signed.astype(np.float64).T
    got = np.asarray(rotate_query(q, rot_s, scale).astype(jnp.float32))
    assert np.array_equal(got, np.asarray(jnp.asarray(want.astype(np.float32)).astype(jnp.float16).astype(jnp.float32)))
