"""tq_jax on a CUDA GPU at realistic sizes (``pytest -m gpu``; skipped without CUDA).

The sweep of the kernel issues: seq_lens 1, 5, 9, 15, 16, 17, 25, 33, page +-1
and 4k+; q_len 1, 8 (seq_len 9, page 16), 127/128/129 and whole prefills; GQA
14/2 (D=64), 32/8, 8/1, 64/4, 28/4; windows 1, 8, < page, = seq_len, > seq_len
and across many pages; soft caps 30 and 50; sinks; every preset and head dim;
pages 1, 16, 48, 128; caches over 2 GiB with the used pages at the far end
(one in the uint16-view range, one in the 64-bit-offset range); in-place stores
under donation. Every attention case runs every path, with NaN-poisoned outputs
and garbage-filled unused pages, against the float64 reference on the same bytes.
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
from parity.tolerances import compare_store
from tqjax_cases import (GARBAGE_BYTE, attend, attention_failure, build_attention_case, paths_for,
                         random_tokens)

pytestmark = pytest.mark.gpu

PATHS = tq_spec.dispatch.PATH_NAMES
_DECODE_LENS = [1, 5, 9, 15, 16, 17, 25, 33, 4100]  # page 16: 15/16/17 are page -1/0/+1


def _seed(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def _check_paths(case, name):
    failures = []
    for path in paths_for(case):
        out = attend(case, path)
        failure = attention_failure(case, out)
        if failure:
            failures.append(f"{name} [{path}]: {failure}")
    assert not failures, "\n".join(failures)


_PRESET_SWEEP = [
    ("turboquant_k8v4", 64), ("turboquant_k8v4", 96), ("turboquant_k8v4", 128), ("turboquant_k8v4", 512),
    ("turboquant_4bit_nc", 64), ("turboquant_4bit_nc", 128), ("turboquant_4bit_nc", 256),
    ("turboquant_4bit_nc", 512), ("turboquant_k3v4_nc", 128), ("turboquant_3bit_nc", 128),
    ("bf16", 128), ("fp16", 80),
]


@pytest.mark.parametrize("preset,head_dim", _PRESET_SWEEP)
def test_gpu_decode_batch_every_preset(preset, head_dim):
    name = f"decode-{preset}-{head_dim}"
    case = build_attention_case(_seed(name), preset=preset, head_dim=head_dim, num_q_heads=16, num_kv_heads=4,
                                block_size=16, seq_lens=_DECODE_LENS, q_lens=[1] * len(_DECODE_LENS),
                                q_dtype="bfloat16")
    _check_paths(case, name)


@pytest.mark.parametrize(
    "preset,head_dim,hq,hkv,page,q_dtype",
    [
        ("turboquant_4bit_nc", 64, 14, 2, 16, "bfloat16"),
        ("turboquant_k8v4", 128, 32, 8, 16, "float16"),
        ("turboquant_k8v4", 128, 8, 1, 1, "bfloat16"),
        ("turboquant_3bit_nc", 128, 64, 4, 48, "bfloat16"),
        ("turboquant_k3v4_nc", 128, 28, 4, 128, "float16"),
        ("bf16", 128, 32, 8, 16, "float32"),
        ("turboquant_k8v4", 256, 16, 2, 16, "float32"),
        ("turboquant_4bit_nc", 128, 16, 4, 16, "float32"),
    ],
)
def test_gpu_prefill_and_mixed_batches(preset, head_dim, hq, hkv, page, q_dtype):
    """Whole prefills (127/128/129), q_len 8 at seq_len 9, continuations and decodes together."""
    name = f"mixed-{preset}-{head_dim}-{hq}-{hkv}-{page}-{q_dtype}"
    case = build_attention_case(_seed(name), preset=preset, head_dim=head_dim, num_q_heads=hq,
                                num_kv_heads=hkv, block_size=page,
                                seq_lens=[9, 129, 128, 127, 300, 17, 1, 2000],
                                q_lens=[8, 129, 128, 127, 40, 1, 1, 1], q_dtype=q_dtype)
    _check_paths(case, name)


@pytest.mark.parametrize("window", [1, 8, 12, 100, 300, 1000],
                         ids=["w1", "w8", "w<page", "w-many-pages", "w=seq", "w>seq"])
def test_gpu_sliding_windows(window):
    name = f"window-{window}"
    case = build_attention_case(_seed(name), preset="turboquant_k3v4_nc", head_dim=128, num_q_heads=8,
                                num_kv_heads=2, block_size=16, seq_lens=[300, 33, 9, 4100],
                                q_lens=[129, 1, 9, 1], q_dtype="bfloat16", sliding_window=window)
    _check_paths(case, name)


@pytest.mark.parametrize(
    "preset,head_dim,cap,window",
    [("turboquant_3bit_nc", 64, 30.0, None), ("bf16", 128, 50.0, 8), ("turboquant_k8v4", 128, 30.0, 40),
     ("turboquant_k3v4_nc", 256, 50.0, None)],
)
def test_gpu_soft_cap_and_sinks(preset, head_dim, cap, window):
    name = f"cap-{preset}-{cap}-{window}"
    q_dtype = "float32" if preset == "turboquant_k3v4_nc" else "bfloat16"
    case = build_attention_case(_seed(name), preset=preset, head_dim=head_dim, num_q_heads=8, num_kv_heads=2,
                                block_size=16, seq_lens=[200, 17, 1000], q_lens=[64, 1, 1], q_dtype=q_dtype,
                                logits_soft_cap=cap, sinks=True, sliding_window=window)
    _check_paths(case, name)


_STORE_SWEEP = (
    [(p, d) for p in ("turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc") for d in (64, 128, 256, 512)]
    + [("turboquant_k8v4", d) for d in (64, 96, 128, 256, 512)]
    + [("bf16", 128), ("bf16", 80), ("fp16", 256), ("fp16", 128), ("fp16", 40)]
)


@pytest.mark.parametrize("preset,head_dim", _STORE_SWEEP)
def test_gpu_store_every_preset_and_head_dim(preset, head_dim):
    rng = _seed(f"store-{preset}-{head_dim}")
    lay = tq_spec.layout(preset, head_dim)
    t, h, n, p = 257, 4, 40, 16
    dtype = ("bfloat16", "float16", "float32")[head_dim % 3]
    key = random_tokens(rng, (t, h, head_dim), dtype)
    value = random_tokens(rng, (t, h, head_dim), dtype)
    cache = rng.integers(0, 256, (n, p, h, lay.slot_bytes), dtype=np.uint8)
    slots = rng.permutation(n * p)[:t].astype(np.int64)
    slots[::7] = -1
    out = tq_jax.store_kv(jnp.asarray(key), jnp.asarray(value), jnp.asarray(cache), jnp.asarray(slots),
                          preset=preset)
    cmp = compare_store(np.asarray(out), key, value, cache, slots, preset=preset)
    print(cmp.describe())
    assert cmp.ok, cmp.describe()
    if lay.preset.key_format == "fp8":
        assert cmp.agreement["key_fp8"] == 1.0, cmp.describe()
    if lay.preset.key_format == "raw":
        assert min(cmp.agreement.values()) == 1.0, cmp.describe()


def test_gpu_store_is_in_place_under_donation():
    preset, d = "turboquant_k8v4", 128
    lay = tq_spec.layout(preset, d)
    rng = _seed("inplace")
    cache = jnp.asarray(rng.integers(0, 256, (64, 16, 2, lay.slot_bytes), dtype=np.uint8))
    before = np.asarray(cache)
    key = random_tokens(rng, (5, 2, d), "bfloat16")
    slots = np.array([3, -1, 100, 1000, 7], np.int32)
    step = jax.jit(functools.partial(tq_jax.store_kv, preset=preset), donate_argnums=(2,))
    pointer = cache.unsafe_buffer_pointer()
    out = step(jnp.asarray(key), jnp.asarray(key), cache, jnp.asarray(slots))
    assert out.unsafe_buffer_pointer() == pointer, "store_kv copied the donated cache"
    cmp = compare_store(np.asarray(out), key, key, before, slots, preset=preset)
    assert cmp.ok, cmp.describe()


@pytest.mark.parametrize("gib", [3.0, 4.5], ids=["3GiB-word-view", "4.5GiB-64bit-offsets"])
def test_gpu_cache_over_2gib_pages_at_far_end(gib):
    """Store into and attend from pages at the end of a huge cache; every other byte untouched."""
    big_bytes = far_end_case(gib)
    assert big_bytes > 2**31


def far_end_case(gib: float) -> int:
    """The body of the huge-cache test (any size); returns the cache's byte count."""
    preset, d, hq, hkv, page = "turboquant_k8v4", 128, 8, 2, 16
    name = f"huge-{gib}"
    case = build_attention_case(_seed(name), preset=preset, head_dim=d, num_q_heads=hq, num_kv_heads=hkv,
                                block_size=page, seq_lens=[40, 300], q_lens=[1, 33], q_dtype="bfloat16",
                                extra_pages=0)
    small = case.kv_cache
    page_bytes = int(np.prod(small.shape[1:]))
    n_big = int(gib * 2**30) // page_bytes
    start = n_big - small.shape[0]
    big = jnp.concatenate([jnp.full((start,) + small.shape[1:], GARBAGE_BYTE, jnp.uint8), jnp.asarray(small)])
    big_bytes = int(big.nbytes)
    table = case.block_table + start

    # Store new tokens into the far pages (slots past 2**31 bytes), then attend.
    rng = _seed(name + "-store")
    k_new = random_tokens(rng, (3, hkv, d), "bfloat16")
    v_new = random_tokens(rng, (3, hkv, d), "bfloat16")
    positions = [(1, 299), (1, 298), (0, 39)]  # rewrite last tokens of both sequences
    slots_small = np.array([case.block_table[b, j // page] * page + j % page for b, j in positions], np.int64)
    step = jax.jit(functools.partial(tq_jax.store_kv, preset=preset), donate_argnums=(2,))
    big = step(jnp.asarray(k_new), jnp.asarray(v_new), big, jnp.asarray(slots_small + start * page, jnp.int32))
    got_small = np.asarray(big[start:])
    cmp = compare_store(got_small, k_new, v_new, small, slots_small, preset=preset)
    assert cmp.ok, cmp.describe()
    assert bool(jnp.all(big[:start] == GARBAGE_BYTE)), "bytes before the used pages changed"

    case.kv_cache = got_small  # the reference reads the compact copy with the original table
    failures = []
    for path in paths_for(case):
        out = tq_jax.paged_attention(jnp.asarray(case.query), big, jnp.asarray(table), jnp.asarray(case.seq_lens),
                                     jnp.asarray(case.query_start_loc), preset=preset, path=path)
        failure = attention_failure(case, out)
        if failure:
            failures.append(f"{name} [{path}]: {failure}")
    assert not failures, "\n".join(failures)
    return big_bytes
