"""The float64 reference against an independent dense implementation."""

from __future__ import annotations

import math

import numpy as np
import pytest

import tq_spec
from tq_spec import reference


def make_case(rng, *, preset, head_dim, page, seq_lens, q_lens, hkv, group, garbage=0xFF):
    """A paged cache holding every token of every sequence, stored by the reference.

    Block tables are shuffled; unused pages and table padding hold garbage that
    decodes to NaN/Inf for every preset (0xFF bytes).
    """
    seq_lens = np.asarray(seq_lens, np.int32)
    q_lens = np.asarray(q_lens, np.int32)
    b = len(seq_lens)
    blocks_per_seq = [max(1, -(-int(n) // page)) for n in seq_lens]
    max_blocks = max(blocks_per_seq) + 1
    n_blocks = sum(blocks_per_seq) + 3
    perm = rng.permutation(n_blocks)
    table = np.full((b, max_blocks), n_blocks - 1, np.int32)  # padding points at a garbage page
    cursor = 0
    for i, nb in enumerate(blocks_per_seq):
        table[i, :nb] = perm[cursor:cursor + nb]
        cursor += nb
    lay = tq_spec.layout(preset, head_dim)
    cache = np.full((n_blocks, page, hkv, lay.slot_bytes), garbage, np.uint8)
    total = int(seq_lens.sum())
    key = rng.standard_normal((total, hkv, head_dim)).astype(np.float32)
    value = rng.standard_normal((total, hkv, head_dim)).astype(np.float32)
    slots = np.concatenate([table[i, np.arange(n) // page].astype(np.int64) * page + np.arange(n) % page
                            for i, n in enumerate(seq_lens)])
    cache = reference.store_kv(key, value, cache, slots, preset=preset)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = rng.standard_normal((int(qsl[-1]), hkv * group, head_dim)).astype(np.float32)
    return query, cache, table, seq_lens, qsl


def dense_attention(query, cache, table, seq_lens, qsl, *, preset, scale=None, window=None, cap=None,
                    sinks=None):
    """Explicit mask matrix + explicit softmax with a sink column, one head at a time."""
    t, hq, d = query.shape
    hkv = cache.shape[2]
    page = cache.shape[1]
    k_all, v_all = reference.dequantize_cache(cache, preset=preset, head_dim=d)
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = np.zeros((t, hq, d))
    for b in range(len(seq_lens)):
        n = int(seq_lens[b])
        rows = np.arange(qsl[b], qsl[b + 1])
        if not len(rows):
            continue
        j = np.arange(n)
        k = k_all[table[b, j // page], j % page]  # [n, Hkv, D]
        v = v_all[table[b, j // page], j % page]
        pos = n - len(rows) + np.arange(len(rows))
        mask = j[None, :] <= pos[:, None]
        if window is not None:
            mask &= j[None, :] > pos[:, None] - window
        for h in range(hq):
            kv = h // (hq // hkv)
            logits = scale * query[rows, h].astype(np.float64) @ k[:, kv].T
            if cap is not None:
                logits = cap * np.tanh(logits / cap)
            for r in range(len(rows)):
                vis = mask[r]
                if not vis.any():
                    continue
                cols = list(logits[r, vis]) + ([float(sinks[h])] if sinks is not None else [])
                m = max(cols)
                w = np.exp(np.array(cols) - m)
                p = w / w.sum()
                out[rows[r], h] = p[: vis.sum()] @ v[vis, kv]
    return out


CASES = [
    # (preset, head_dim, page, seq_lens, q_lens, hkv, group, window, cap, sinks)
    ("turboquant_4bit_nc", 64, 16, [9], [8], 2, 7, None, None, False),
    ("turboquant_k3v4_nc", 64, 4, [1, 5, 17, 33], [1, 1, 0, 33], 1, 8, 3, None, True),
    ("turboquant_3bit_nc", 128, 16, [40, 7], [3, 7], 2, 2, 1, 30.0, False),
    ("turboquant_k8v4", 64, 48, [100, 2, 0], [1, 2, 0], 2, 1, None, 50.0, True),
    ("turboquant_k8v4", 40, 3, [26], [26], 1, 3, 200, None, False),
    ("bf16", 64, 1, [11, 6], [4, 6], 1, 2, 6, None, True),
    ("fp16", 32, 7, [30], [12], 2, 1, 9, 20.0, False),
    ("turboquant_4bit_nc", 128, 16, [300, 64], [130, 1], 1, 2, 128, None, False),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-D{c[1]}-P{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_reference_matches_dense(case):
    preset, d, page, seq_lens, q_lens, hkv, group, window, cap, use_sinks = case
    rng = np.random.default_rng(abs(hash(str(case))) % 2**32)
    query, cache, table, sl, qsl = make_case(rng, preset=preset, head_dim=d, page=page, seq_lens=seq_lens,
                                             q_lens=q_lens, hkv=hkv, group=group)
    sinks = rng.standard_normal(hkv * group).astype(np.float32) * 2 if use_sinks else None
    got = reference.paged_attention(query, cache, table, sl, qsl, preset=preset, sliding_window=window,
                                    logits_soft_cap=cap, sinks=sinks)
    want = dense_attention(query, cache, table, sl, qsl, preset=preset, window=window, cap=cap, sinks=sinks)
    assert got.dtype == np.float64 and got.shape == query.shape
    assert np.isfinite(got).all()  # garbage pages never reach the output
    # Dense scores keys in model space, the reference in rotated space: they differ
    # only by the float32 rotation's departure from orthogonality.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(12))
def test_reference_matches_dense_random(seed):
    rng = np.random.default_rng(1000 + seed)
    preset = tq_spec.PRESET_NAMES[seed % len(tq_spec.PRESET_NAMES)]
    d = 64
    page = int(rng.choice([1, 2, 5, 16, 48]))
    group = int(rng.choice([1, 2, 3, 7, 8]))
    b = int(rng.integers(1, 5))
    seq_lens = rng.integers(0, 60, size=b)
    q_lens = np.array([rng.integers(0, n + 1) for n in seq_lens])
    window = [None, 1, 3, 1000][seed % 4]
    cap = 30.0 if seed % 3 == 0 else None
    sinks = rng.standard_normal(2 * group).astype(np.float32) if seed % 2 else None
    query, cache, table, sl, qsl = make_case(rng, preset=preset, head_dim=d, page=page, seq_lens=seq_lens,
                                             q_lens=q_lens, hkv=2, group=group)
    got = reference.paged_attention(query, cache, table, sl, qsl, preset=preset, sliding_window=window,
                                    logits_soft_cap=cap, sinks=sinks, scale=0.3)
    want = dense_attention(query, cache, table, sl, qsl, preset=preset, window=window, cap=cap, sinks=sinks,
                           scale=0.3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_very_negative_logits_keep_their_softmax():
    """All logits below -5e4: a finite mask sentinel would win; the reference must not care."""
    rng = np.random.default_rng(3)
    query, cache, table, sl, qsl = make_case(rng, preset="bf16", head_dim=64, page=4, seq_lens=[10],
                                             q_lens=[3], hkv=1, group=1)
    got = reference.paged_attention(query, cache, table, sl, qsl, preset="bf16", scale=-1e5)
    want = dense_attention(query, cache, table, sl, qsl, preset="bf16", scale=-1e5)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    assert np.abs(got).max() > 0.1


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # quantizing the NaN/Inf values
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("preset", ["bf16", "turboquant_4bit_nc"])
def test_nonfinite_values_reach_only_rows_that_see_them(preset, window):
    """NaN/Inf values of a later token or an out-of-window one never reach a row as 0 * NaN (DESIGN.md:
    masked keys never leak), and reach the rows that see them as IEEE arithmetic does."""
    rng = np.random.default_rng(6)
    d, page, n = 64, 4, 200  # more rows than the reference's query chunk: chunks and windows both cut
    lay = tq_spec.layout(preset, d)
    key = rng.standard_normal((n, 1, d)).astype(np.float32)
    value = rng.standard_normal((n, 1, d)).astype(np.float32)
    value[20, 0, 1], value[150, 0, 2], value[151, 0, 3], value[151, 0, 4] = np.nan, np.inf, -np.inf, np.inf
    table = rng.permutation(n // page)[None].astype(np.int32)
    slots = table[0, np.arange(n) // page].astype(np.int64) * page + np.arange(n) % page
    cache = reference.store_kv(key, value, np.zeros((n // page, page, 1, lay.slot_bytes), np.uint8), slots,
                               preset=preset)
    sl, qsl = np.array([n], np.int32), np.array([0, n], np.int32)
    query = rng.standard_normal((n, 2, d)).astype(np.float32)
    got = reference.paged_attention(query, cache, table, sl, qsl, preset=preset, sliding_window=window)
    want = dense_attention(query, cache, table, sl, qsl, preset=preset, window=window)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.where(np.isinf(want), want, 0), np.where(np.isinf(got), got, 0))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-9, atol=1e-9)
    hidden_rows = np.arange(20) if window is None else np.r_[np.arange(20), np.arange(26, 150)]
    assert np.isfinite(got[hidden_rows]).all()
    assert np.isnan(got[20:26]).any()


def test_query_in_window_of_one_sees_only_itself():
    rng = np.random.default_rng(4)
    query, cache, table, sl, qsl = make_case(rng, preset="fp16", head_dim=32, page=2, seq_lens=[7],
                                             q_lens=[7], hkv=1, group=1)
    got = reference.paged_attention(query, cache, table, sl, qsl, preset="fp16", sliding_window=1)
    _, v_all = reference.dequantize_cache(cache, preset="fp16", head_dim=32)
    j = np.arange(7)
    np.testing.assert_allclose(got[:, 0], v_all[table[0, j // 2], j % 2, 0])


def test_sinks_only_scale_the_denominator():
    rng = np.random.default_rng(5)
    query, cache, table, sl, qsl = make_case(rng, preset="bf16", head_dim=32, page=4, seq_lens=[9],
                                             q_lens=[2], hkv=1, group=2)
    plain = reference.paged_attention(query, cache, table, sl, qsl, preset="bf16")
    huge_negative = np.full(2, -1e30, np.float32)
    np.testing.assert_allclose(
        reference.paged_attention(query, cache, table, sl, qsl, preset="bf16", sinks=huge_negative), plain)
    dominant = np.full(2, 1e4, np.float32)
    assert np.abs(reference.paged_attention(query, cache, table, sl, qsl, preset="bf16", sinks=dominant)).max() < 1e-30


# ------------------------------------------------------------------------------ store


@pytest.mark.parametrize("preset", tq_spec.PRESET_NAMES)
def test_store_writes_only_named_slots(preset):
    rng = np.random.default_rng(6)
    d = 64
    lay = tq_spec.layout(preset, d)
    cache = rng.integers(0, 256, size=(4, 8, 2, lay.slot_bytes), dtype=np.uint8)
    key = rng.standard_normal((6, 2, d)).astype(np.float32) * 3
    value = rng.standard_normal((6, 2, d)).astype(np.float32)
    slots = np.array([31, -1, 0, 17, -1, 9], np.int64)
    new = reference.store_kv(key, value, cache, slots, preset=preset)
    assert new is not cache
    touched = np.zeros((4, 8), bool)
    touched[slots[slots >= 0] // 8, slots[slots >= 0] % 8] = True
    np.testing.assert_array_equal(new[~touched], cache[~touched])
    keep = slots >= 0
    np.testing.assert_array_equal(new[slots[keep] // 8, slots[keep] % 8],
                                  reference.quantize_kv(key[keep], value[keep], preset=preset))


@pytest.mark.parametrize("preset", tq_spec.PRESET_NAMES)
def test_quantize_round_trip_error_is_bounded(preset):
    rng = np.random.default_rng(7)
    d = 128
    key = rng.standard_normal((200, 2, d)).astype(np.float32)
    value = rng.standard_normal((200, 2, d)).astype(np.float32)
    k_hat, v_hat = reference.dequantize_kv(reference.quantize_kv(key, value, preset=preset), preset=preset,
                                           head_dim=d)
    p = tq_spec.get_preset(preset)
    rel_k = np.linalg.norm(k_hat - key) / np.linalg.norm(key)
    rel_v = np.linalg.norm(v_hat - value) / np.linalg.norm(value)
    # Expected distortions: fp8 e4m3 ~ 2**-4 relative per element; b-bit Lloyd-Max
    # keys sqrt(0.0095 / 0.0345) for 4 / 3 bits; b-bit uniform values on a
    # Gaussian's range (~6 sigma / (2**b - 1)) / sqrt(12); raw: half an ulp.
    key_bound = {"fp8": 0.04, "mse": {4: 0.11, 3: 0.2}.get(p.key_bits), "raw": 0.003}[p.key_format]
    value_bound = {4: 0.14, 3: 0.3, 16: 0.003}[p.value_bits]
    assert rel_k < key_bound, rel_k
    assert rel_v < value_bound, rel_v


def test_value_quantization_follows_the_contract():
    v = np.array([[-1.0, 0.0, 0.5, 2.0] + [0.25] * 60], np.float32)
    slot = reference.quantize_kv(v, v, preset="turboquant_k8v4")
    lay = tq_spec.layout("turboquant_k8v4", 64)
    codes = tq_spec.unpack_bits(slot[:, lay.value_offset:lay.value_offset + lay.value_bytes], 4, 64)
    scale = np.float32(3.0) / np.float32(15)
    want = np.clip(np.floor((v.astype(np.float64) + 1.0) / np.float64(scale) + 0.5), 0, 15)
    np.testing.assert_array_equal(codes, want)
    assert tq_spec.fp16_from_bytes(slot[0, lay.value_scale_offset:lay.value_scale_offset + 2]) == np.float16(scale)
    assert tq_spec.fp16_from_bytes(slot[0, lay.value_zero_offset:lay.value_zero_offset + 2]) == -1.0
    # Constant rows use the 1e-8 scale floor and decode exactly.
    const = np.full((1, 64), 0.75, np.float32)
    _, back = reference.dequantize_kv(reference.quantize_kv(const, const, preset="turboquant_k8v4"),
                                      preset="turboquant_k8v4", head_dim=64)
    np.testing.assert_allclose(back, const, atol=1e-6)


def test_mse_key_codes_follow_the_contract():
    d = 64
    rng = np.random.default_rng(8)
    k = rng.standard_normal((3, d)) * 5
    slot = reference.quantize_kv(k, k, preset="turboquant_4bit_nc")
    n = np.linalg.norm(k, axis=1, keepdims=True)
    y = (k / (n + 1e-8)) @ tq_spec.rotation(d).astype(np.float64).T
    mids = tq_spec.codebook(d, 4).midpoints.astype(np.float64)
    want = (y[..., None] >= mids).sum(-1)
    lay = tq_spec.layout("turboquant_4bit_nc", d)
    np.testing.assert_array_equal(tq_spec.unpack_bits(slot[:, :lay.key_bytes], 4, d), want)
    np.testing.assert_array_equal(tq_spec.fp16_from_bytes(slot[:, lay.key_norm_offset:lay.key_norm_offset + 2]),
                                  n[:, 0].astype(np.float16))
    # A coordinate exactly on a midpoint goes up.
    assert (np.array([mids[3]])[:, None] >= mids).sum() == 4


def test_k8v4_keys_saturate():
    k = np.zeros((1, 64), np.float32)
    k[0, :4] = [1000.0, -1000.0, 1.9747, 3.0]
    k[0, 4:] = 0.5
    slot = reference.quantize_kv(k, k, preset="turboquant_k8v4")
    np.testing.assert_array_equal(tq_spec.fp8_e4m3fn_decode(slot[0, :4]), [448.0, -448.0, 2.0, 3.0])


def test_randomized_rotation_round_trips():
    d = 128
    rot = tq_spec.rotation(d, "randomized_hadamard", seed=11)
    rng = np.random.default_rng(9)
    k = rng.standard_normal((50, d))
    slots = reference.quantize_kv(k, k, preset="turboquant_4bit_nc", rotation=rot)
    k_hat, _ = reference.dequantize_kv(slots, preset="turboquant_4bit_nc", head_dim=d, rotation=rot)
    assert np.linalg.norm(k_hat - k) / np.linalg.norm(k) < 0.11
    k_wrong, _ = reference.dequantize_kv(slots, preset="turboquant_4bit_nc", head_dim=d)
    assert np.linalg.norm(k_wrong - k) / np.linalg.norm(k) > 0.5
