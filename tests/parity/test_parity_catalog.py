"""The catalog: stable unique ids, every regression class present, filters, reproducible problems."""

from __future__ import annotations

import numpy as np
import pytest

import tq_spec
from parity.catalog.cases import AttentionCase, ModelCase, matches
from parity.catalog.catalog import GROUP_NOTES, build_catalog, select
from parity.catalog.problem import FAR_OFFSET_BYTES, build_problem, poison_row


@pytest.fixture(scope="module")
def quick():
    return build_catalog("quick", 0)


@pytest.fixture(scope="module")
def full():
    return build_catalog("full", 0)


def test_ids_unique_and_stable(quick, full):
    for cases in (quick, full):
        ids = [c.id for c in cases]
        assert len(ids) == len(set(ids))
    assert [c.id for c in build_catalog("quick", 0)] == [c.id for c in quick]


def test_regression_ids_do_not_depend_on_seed(quick):
    other = build_catalog("quick", 12345)
    fixed = {c.id for c in quick if c.group != "random"}
    assert fixed == {c.id for c in other if c.group != "random"}
    # The random sweep is sampled by seed (and reproducibly so).
    assert {c.id for c in quick if c.group == "random"} != {c.id for c in other if c.group == "random"}


def test_pinned_ids(quick, full):
    # Repro lines printed by earlier runs must keep finding their case.
    assert "flashinfer-short:4bit-d64-h14x2-p16-s9q8-bf16" in {c.id for c in quick}
    assert "flashinfer-short:k8v4-d64-h14x2-p16-s9q8-bf16" in {c.id for c in full}


@pytest.mark.parametrize("mode", ["quick", "full"])
def test_every_group_present(mode, quick, full):
    cases = quick if mode == "quick" else full
    assert {c.group for c in cases} == set(GROUP_NOTES)


def test_flashinfer_short_lengths(full):
    got = {c.seqs for c in full if c.group == "flashinfer-short"}
    for s in (1, 5, 9, 15, 16, 17, 25, 33):
        assert ((s, min(8, s)),) in got and ((s, 1),) in got
    exact = {c.preset for c in full if c.group == "flashinfer-short" and c.seqs == ((9, 8),)}
    assert exact == set(tq_spec.PRESET_NAMES)
    case = next(c for c in full if c.id == "flashinfer-short:k8v4-d64-h14x2-p16-s9q8-bf16")
    assert (case.num_q_heads, case.num_kv_heads, case.head_dim, case.block_size) == (14, 2, 64, 16)


def test_full_coverage_of_axes(full):
    attn = [c for c in full if isinstance(c, AttentionCase)]
    ratios = {c.num_q_heads // c.num_kv_heads for c in attn}
    assert {1, 3, 5, 7, 16, 20, 32} <= ratios
    assert {1, 3, 48} <= {c.block_size for c in attn}
    # Every preset (so every bit width) at two or more head dims, and every head
    # dim 64..512 under a rotated (mse) preset and an unrotated one; the full
    # product is left out to keep `--full` inside its 10-minute budget.
    have = {(c.preset, c.head_dim) for c in attn}
    for preset in tq_spec.PRESET_NAMES:
        assert len({d for p, d in have if p == preset}) >= 2, preset
    mse = {p for p in tq_spec.PRESET_NAMES if tq_spec.get_preset(p).key_format == "mse"}
    for d in (64, 128, 256, 512):
        assert any((p, d) in have for p in mse) and any((p, d) in have for p in set(tq_spec.PRESET_NAMES) - mse), d
    # Windows <= 128 and > 128 on decode, extend and continuation batches.
    for mix in ("decode", "prefill", "prefix-cached"):
        ws = {c.sliding_window for c in attn if c.group == "window-paths" and mix in c.all_tags | {"mixed"}}
        assert any(w is not None and w <= 128 for w in ws) and any(w is not None and w > 128 for w in ws)
    assert any(c.logits_soft_cap is not None and c.sliding_window is not None for c in attn)
    assert {"nan", "inf16", "inf-bf16"} <= {c.poison for c in attn}
    chunked = [c for c in attn if "chunking" in c.checks]
    assert chunked and all(c.chunks == (1, 7, 16, 128) for c in chunked)
    assert any(c.far_pages and c.gpu_only for c in attn)


def test_model_case_shape(quick, full):
    for cases in (quick, full):
        model = next(c for c in cases if isinstance(c, ModelCase))
        layers = model.layers
        sliding = [lay for lay in layers[:5]]
        assert all(lay.head_dim == 256 and lay.sliding_window for lay in sliding)
        assert layers[5].head_dim == 512 and layers[5].sliding_window is None
        assert layers[0].preset == "bf16"
        assert any(lay.reads_cache_of for lay in layers)
        assert len({lay.preset for lay in layers}) >= 3
        # Two layers with equal shapes but different windows (stale-metadata bug class).
        l1, l2 = layers[1], layers[2]
        assert (l1.preset, l1.head_dim) == (l2.preset, l2.head_dim) and l1.sliding_window != l2.sliding_window


def test_filter_by_substring_and_tag(quick):
    assert all("gqa" in c.id or "gqa" in c.all_tags for c in select(quick, ["gqa"]))
    by_tag = select(quick, ["window"])
    assert by_tag and all(c.kind == "model" or c.sliding_window is not None for c in by_tag if c.kind == "attention")
    one = select(quick, ["flashinfer-short:4bit-d64-h14x2-p16-s9q8-bf16"])
    assert [c.id for c in one] == ["flashinfer-short:4bit-d64-h14x2-p16-s9q8-bf16"]
    assert select(quick, []) == list(quick)
    assert not select(quick, ["no-such-thing"])
    gpu = select(quick, ["gpu-only"])
    assert gpu and all(c.gpu_only for c in gpu)
    assert matches(quick[0], [quick[0].group])


def _case(**kw):
    base = dict(group="t", preset="turboquant_4bit_nc", head_dim=64, num_q_heads=4, num_kv_heads=2,
                block_size=4, seqs=((9, 3), (5, 1), (6, 0)), sliding_window=3)
    base.update(kw)
    return AttentionCase(**base)


def test_problem_is_reproducible_and_poisoned():
    case = _case()
    a, b = build_problem(case, 7), build_problem(case, 7)
    for name in ("key", "value", "slot_mapping", "cache_before", "query", "seq_lens", "query_start_loc"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    np.testing.assert_array_equal(a.block_table, b.block_table)
    c = build_problem(case, 8)
    assert not np.array_equal(a.key, c.key)
    # The cache starts all poison; -1 rows exist and are the only unnamed rows.
    assert np.all(a.cache_before == poison_row("nan", a.layout.slot_bytes))
    assert (a.slot_mapping == -1).any()
    named = np.sort(a.slot_mapping[a.slot_mapping >= 0])
    assert np.array_equal(named, np.sort(np.concatenate(a.batch.slots)))
    # Table columns past each sequence's pages name spare pages nobody writes.
    used_pages = set((named // case.block_size).tolist())
    for row, (s, _) in zip(a.block_table, case.seqs):
        tail = row[-(-s // case.block_size):]
        assert tail.size and not (set(tail.tolist()) & used_pages)
    # Hidden slots: outside the window of every query (seq 0: first query at 6, W=3 -> 0..3),
    # and every slot of the sequence without queries.
    hidden = set(a.hidden_slots.tolist())
    assert set(a.batch.slots[0][:4].tolist()) <= hidden and a.batch.slots[0][4] not in hidden
    assert set(a.batch.slots[2].tolist()) <= hidden


def test_very_negative_logits_are_below_sentinel():
    case = _case(data="very-negative", sliding_window=None, preset="turboquant_3bit_nc")
    pr = build_problem(case, 0)
    cache = tq_spec.reference.store_kv(pr.key, pr.value, pr.cache_before, pr.slot_mapping, preset=case.preset)
    k, _ = tq_spec.reference.dequantize_cache(cache, preset=case.preset, head_dim=case.head_dim)
    g = case.num_q_heads // case.num_kv_heads
    worst = -np.inf
    for b, (s, q) in enumerate(case.seqs):
        slots = pr.batch.slots[b]
        keys = k[slots // case.block_size, slots % case.block_size]  # [s, Hkv, D]
        qs = pr.seq_queries[b].astype(np.float64)
        for h in range(case.num_q_heads):
            logits = qs[:, h] @ keys[:, h // g].T / np.sqrt(case.head_dim)
            if logits.size:
                worst = max(worst, logits.max())
    assert worst < -5e4


def test_far_pages_offsets():
    case = _case(far_pages=True, gpu_only=True, seqs=((5, 1),), sliding_window=None, preset="turboquant_k8v4",
                 head_dim=32)
    lay = tq_spec.layout(case.preset, case.head_dim)
    page_bytes = case.block_size * case.num_kv_heads * lay.slot_bytes
    # Only metadata is checked here (the >2 GiB cache itself is built on GPU runs).
    from parity.catalog.problem import paged_batch
    from parity.catalog.sweeps import rng_for

    base = FAR_OFFSET_BYTES // page_bytes + 1
    batch = paged_batch(case.seqs, case.block_size, rng=rng_for("t"), page_base=base)
    assert int(batch.block_table[0, 0]) * page_bytes > FAR_OFFSET_BYTES


def test_case_validation():
    with pytest.raises(ValueError, match="checks"):
        _case(checks=("nope",))
    with pytest.raises(ValueError, match="q_len"):
        _case(seqs=((3, 4),))
    with pytest.raises(ValueError, match="chunks"):
        _case(checks=("chunking",))
