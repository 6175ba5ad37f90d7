"""tq_jax.paged_attention against the float64 reference on the same cache bytes.

Every path runs on every case (all paths are eligible for every problem in
tq_spec.dispatch.PATHS). Kernels write into NaN-poisoned outputs (interpret
mode initialises outputs with NaN; `poison=True` aliases explicit NaN buffers
so the same holds on a GPU), caches are garbage (0xFF -> NaN) wherever no
query may look, and parity.tolerances.check_attention sets the bound.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tq_jax
import tq_spec
from tq_jax._src import attention_kernel
from tqjax_cases import (CPU_HEAD_DIM, attend, attention_failure, build_attention_case, paths_for,
                         skip_if_ineligible)

PATHS = tq_spec.dispatch.PATH_NAMES
# Query dtypes cycle over the presets (float32 queries get IEEE fp32 dots).
_Q_DTYPE = {
    "turboquant_k8v4": "float32", "turboquant_4bit_nc": "bfloat16", "turboquant_k3v4_nc": "float16",
    "turboquant_3bit_nc": "float32", "bf16": "float32", "fp16": "float16",
}
# decode + chunked-prefill continuation + whole prefill + empty sequence + short decode
_MIXED = dict(seq_lens=[9, 1, 17, 0, 6], q_lens=[2, 1, 8, 0, 6])


def _check(case, out):
    failure = attention_failure(case, out)
    assert failure is None, failure


def _check_all_paths(case, **kw):
    for path in paths_for(case):
        _check(case, attend(case, path, **kw))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("preset", tq_spec.PRESET_NAMES)
def test_mixed_batch_every_preset_every_path(preset, path):
    rng = np.random.default_rng(zlib.crc32(f"{preset}-{path}".encode()))
    case = build_attention_case(rng, preset=preset, head_dim=CPU_HEAD_DIM[preset], num_q_heads=6,
                                num_kv_heads=2, block_size=5, q_dtype=_Q_DTYPE[preset], **_MIXED)
    skip_if_ineligible(case, path)
    _check(case, attend(case, path))


@pytest.mark.parametrize("preset", tq_spec.PRESET_NAMES)
def test_window_soft_cap_sinks_every_preset(preset):
    rng = np.random.default_rng(100 + list(tq_spec.PRESET_NAMES).index(preset))
    case = build_attention_case(rng, preset=preset, head_dim=CPU_HEAD_DIM[preset], num_q_heads=4,
                                num_kv_heads=2, block_size=4, q_dtype=_Q_DTYPE[preset], sliding_window=4,
                                logits_soft_cap=30.0, sinks=True, **_MIXED)
    _check_all_paths(case)


@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads,block_size",
    [(7, 1, 1), (4, 4, 48), (16, 1, 3), (20, 2, 16)],
    ids=["gqa7-page1", "mha-page48", "gqa16", "gqa10-page16"],
)
def test_gqa_ratios_and_page_sizes(num_q_heads, num_kv_heads, block_size):
    rng = np.random.default_rng(num_q_heads * 100 + block_size)
    case = build_attention_case(rng, preset="turboquant_k8v4", head_dim=40, num_q_heads=num_q_heads,
                                num_kv_heads=num_kv_heads, block_size=block_size, seq_lens=[50, 3, 17],
                                q_lens=[3, 1, 17], q_dtype="bfloat16")
    _check_all_paths(case)


@pytest.mark.parametrize("window", [1, 9, 60], ids=["w1", "w=seq", "w>seq"])
def test_sliding_windows(window):
    rng = np.random.default_rng(window)
    case = build_attention_case(rng, preset="turboquant_3bit_nc", head_dim=64, num_q_heads=2, num_kv_heads=1,
                                block_size=4, seq_lens=[9, 33, 5], q_lens=[9, 2, 1], sliding_window=window,
                                q_dtype="float32")
    _check_all_paths(case)


def test_seq9_page16_qlen8():
    """A peer fell back to a non-paged kernel for max kv length < 16 (DESIGN.md section 7)."""
    rng = np.random.default_rng(9)
    case = build_attention_case(rng, preset="turboquant_4bit_nc", head_dim=64, num_q_heads=4, num_kv_heads=2,
                                block_size=16, seq_lens=[9], q_lens=[8], q_dtype="bfloat16")
    _check_all_paths(case)


def test_more_sequences_than_one_scan_chunk():
    """130 sequences: a tile finds its sequence over two 128-sequence chunks of the
    query_start_loc scan (`attention_kernel._find_sequence`), decode and extend."""
    rng = np.random.default_rng(130)
    q_lens = [int(x) for x in rng.integers(0, 3, 130)]
    seq_lens = [q + int(x) for q, x in zip(q_lens, rng.integers(0, 4, 130))]
    case = build_attention_case(rng, preset="turboquant_4bit_nc", head_dim=64, num_q_heads=2, num_kv_heads=1,
                                block_size=2, seq_lens=seq_lens, q_lens=q_lens, q_dtype="bfloat16")
    for path in ("decode", "extend"):
        _check(case, attend(case, path))


def test_decode_with_empty_splits():
    """More splits than tiles: empty partitions must merge as nothing."""
    rng = np.random.default_rng(12)
    case = build_attention_case(rng, preset="fp16", head_dim=64, num_q_heads=2, num_kv_heads=1, block_size=8,
                                seq_lens=[3, 40, 1], q_lens=[1, 1, 1], q_dtype="float16", sinks=True)
    _check(case, attend(case, "decode", num_splits=5))


@pytest.mark.parametrize("path", PATHS)
def test_word_view_paths(path):
    """The uint16 cache view (caches of 2..4 GiB) reads the same values."""
    rng = np.random.default_rng(21)
    case = build_attention_case(rng, preset="turboquant_k3v4_nc", head_dim=64, num_q_heads=3, num_kv_heads=1,
                                block_size=5, q_dtype="bfloat16", **_MIXED)
    _check(case, attend(case, path, word_view=True))


def test_randomized_rotation_public_api():
    preset, d = "turboquant_4bit_nc", 64
    rot = tq_spec.rotation(d, "randomized_hadamard", seed=3)
    rng = np.random.default_rng(31)
    case = build_attention_case(rng, preset=preset, head_dim=d, num_q_heads=4, num_kv_heads=2, block_size=4,
                                q_dtype="float32", rotation=rot, **_MIXED)
    for path in paths_for(case):
        out = tq_jax.paged_attention(*case.jax_args(), preset=preset, rotation=rot, path=path)
        _check(case, out)


def test_public_api_auto_dispatch_and_scale():
    """`path="auto"` on a pure decode batch and on a prefill batch; a custom scale."""
    rng = np.random.default_rng(41)
    for q_lens in ([1, 1, 1], [4, 1, 6]):
        case = build_attention_case(rng, preset="bf16", head_dim=40, num_q_heads=4, num_kv_heads=1,
                                    block_size=4, seq_lens=[7, 12, 6], q_lens=q_lens, q_dtype="bfloat16",
                                    scale=0.3, logits_soft_cap=50.0)
        out = tq_jax.paged_attention(*case.jax_args(), preset="bf16", **case.jax_kwargs())
        _check(case, out)


def test_under_jit_store_then_attend():
    """store_kv + paged_attention in one jitted step, cache donated; metadata static."""
    preset, d = "turboquant_k8v4", 64
    rng = np.random.default_rng(51)
    case = build_attention_case(rng, preset=preset, head_dim=d, num_q_heads=4, num_kv_heads=2, block_size=4,
                                seq_lens=[6, 11], q_lens=[1, 3], q_dtype="bfloat16", sliding_window=8)
    # Re-store the last token of sequence 1 through tq_jax inside the step.
    k_new = np.random.default_rng(52).standard_normal((1, 2, d)).astype(np.float32)
    v_new = np.random.default_rng(53).standard_normal((1, 2, d)).astype(np.float32)
    slot = case.block_table[1, 10 // 4] * 4 + 10 % 4
    expect_cache = tq_spec.reference.store_kv(k_new, v_new, case.kv_cache, np.array([slot]), preset=preset)

    @functools.partial(jax.jit, donate_argnums=(1,), static_argnames=("window",))
    def step(q, cache, bt, sl, qsl, k, v, sm, *, window):
        cache = tq_jax.store_kv(k, v, cache, sm, preset=preset)
        return tq_jax.paged_attention(q, cache, bt, sl, qsl, preset=preset, sliding_window=window), cache

    q, cache, bt, sl, qsl = case.jax_args()
    out, new_cache = step(q, cache, bt, sl, qsl, jnp.asarray(k_new), jnp.asarray(v_new),
                          jnp.asarray([slot], jnp.int32), window=8)
    np.testing.assert_array_equal(np.asarray(new_cache), expect_cache)  # fp8/uniform codes here are exact
    case.kv_cache = expect_cache
    _check(case, out)


def test_zero_query_tokens():
    case = build_attention_case(np.random.default_rng(0), preset="fp16", head_dim=64, num_q_heads=2,
                                num_kv_heads=1, block_size=4, seq_lens=[5, 0], q_lens=[0, 0])
    for path in paths_for(case):
        out = tq_jax.paged_attention(*case.jax_args(), preset="fp16", path=path)
        assert out.shape == (0, 2, 64)


def test_fp8_keys_without_the_hardware_cast(monkeypatch):
    """GPUs below sm_89 cannot cast from float8_e4m3fn in the Triton lowering: the kernels then decode
    fp8 keys with the integer recipe (same values); checked here on every path in interpret mode."""
    from tq_jax._src import config

    monkeypatch.setattr(config, "fp8_hardware_convert", lambda interpret: False)
    rng = np.random.default_rng(61)
    case = build_attention_case(rng, preset="turboquant_k8v4", head_dim=40, num_q_heads=4, num_kv_heads=2,
                                block_size=4, q_dtype="bfloat16", sliding_window=5, sinks=True,
                                scale=0.173, **_MIXED)  # a scale of its own: no cached compilation reused
    for path in ("decode", "extend"):
        _check(case, attend(case, path))


@pytest.mark.parametrize("heads", [attention_kernel.TILE_ORDER_HEADS, 2])
def test_extend_launch_order_takes_every_tile_once_longest_first(heads):
    # The extend path's (tile, kv head) of each program of the grid: every pair exactly once,
    # and within each head the later tiles (more keys, causal) launch first.
    for nx, ny in [(1, 1), (5, 1), (3, 2), (7, 4), (9, 8), (4, 6), (3, 12)]:
        x = jnp.broadcast_to(jnp.arange(nx, dtype=jnp.int32)[None, :], (ny, nx))
        y = jnp.broadcast_to(jnp.arange(ny, dtype=jnp.int32)[:, None], (ny, nx))
        tile, head = attention_kernel._longest_tiles_first(x, y, nx, ny, heads)
        out = np.full((nx, ny), -1)
        out[np.asarray(tile), np.asarray(head)] = np.asarray(y * nx + x)
        assert np.array_equal(np.sort(out.ravel()), np.arange(nx * ny)), (nx, ny)
        assert out[nx - 1, 0] == 0, (nx, ny)
        if nx > 1:
            assert (out[:-1] > out[1:]).all(), (nx, ny, out)
