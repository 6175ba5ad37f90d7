"""`tq_jax._src.launcher`'s wrapping of aliased kernel calls (`_fenced_launch`), on the CPU with a stand-in call.

The stand-in writes ``value`` at ``index`` of its aliased operand, as a store writes slots of a cache. The real
kernel's behaviour under vmap and scan is checked on the GPU (`test_jax_gluon_store.py`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tq_jax._src.launcher import _fenced_launch


def _stand_in(index, value, cache):
    """Operands ``(index, value, cache)``; result 0 is ``cache`` (aliased) with ``value`` at ``index``."""
    return [cache.at[index].set(value)]


LAUNCH = _fenced_launch(_stand_in, frozenset({2}), frozenset({0}))


def test_an_unbatched_call_is_the_call_behind_barriers():
    cache = jnp.arange(6.0)
    (got,) = LAUNCH(jnp.int32(2), jnp.float32(-1.0), cache)
    np.testing.assert_array_equal(np.asarray(got), [0, 1, -1, 3, 4, 5])
    text = jax.jit(LAUNCH).lower(jnp.int32(2), jnp.float32(-1.0), cache).as_text()
    assert text.count("optimization_barrier") == 2, text


def test_vmap_over_the_aliased_operand_runs_one_call_per_element():
    caches = jnp.arange(12.0).reshape(2, 6)
    (got,) = jax.vmap(lambda c: LAUNCH(jnp.int32(4), jnp.float32(-1.0), c))(caches)
    np.testing.assert_array_equal(np.asarray(got), [[0, 1, 2, 3, -1, 5], [6, 7, 8, 9, -1, 11]])
    text = jax.jit(jax.vmap(lambda c: LAUNCH(jnp.int32(4), jnp.float32(-1.0), c))).lower(caches).as_text()
    assert "stablehlo.while" in text and "optimization_barrier" in text, text


def test_vmap_over_other_operands_and_in_axes_other_than_zero():
    cache = jnp.arange(6.0)
    (got,) = jax.vmap(lambda i, v: LAUNCH(i, v, cache))(jnp.array([0, 5], jnp.int32), jnp.array([7.0, 8.0]))
    np.testing.assert_array_equal(np.asarray(got), [[7, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 8]])
    caches = jnp.arange(12.0).reshape(6, 2)  # batch along axis 1
    (got,) = jax.vmap(lambda v, c: LAUNCH(jnp.int32(1), v, c), in_axes=(0, 1))(jnp.array([7.0, 8.0]), caches)
    np.testing.assert_array_equal(np.asarray(got), [[0, 7, 4, 6, 8, 10], [1, 8, 5, 7, 9, 11]])


def test_nested_vmap_and_a_scan_over_stacked_caches():
    caches = jnp.arange(24.0).reshape(2, 2, 6)
    (got,) = jax.vmap(jax.vmap(lambda c: LAUNCH(jnp.int32(0), jnp.float32(-1.0), c)))(caches)
    want = np.arange(24.0).reshape(2, 2, 6)
    want[:, :, 0] = -1
    np.testing.assert_array_equal(np.asarray(got), want)

    def layer(carry, cache):
        (out,) = LAUNCH(carry, jnp.float32(-2.0), cache)
        return carry + 1, out

    _, got = jax.lax.scan(layer, jnp.int32(1), caches[0])
    np.testing.assert_array_equal(np.asarray(got), [[0, -2, 2, 3, 4, 5], [6, 7, -2, 9, 10, 11]])
