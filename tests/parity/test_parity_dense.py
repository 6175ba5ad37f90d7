"""parity.checks.dense (raw K/V attention for the end-to-end check) agrees with the reference on exact caches,
and parity.checks.distortion measures what it should."""

from __future__ import annotations

import numpy as np
import pytest

from parity.catalog.cases import AttentionCase
from parity.checks.dense import dense_attention
from parity.checks.distortion import bounds, measure, within
from parity.catalog.problem import build_problem
from tq_spec import reference


@pytest.mark.parametrize("kw", [
    dict(),
    dict(sliding_window=3),
    dict(sliding_window=1, logits_soft_cap=2.0),
    dict(sinks=True, scale=0.3),
    dict(sliding_window=40, sinks=True),
])
def test_dense_matches_reference_on_an_exact_cache(kw):
    # fp16 data in an fp16 cache: the cache holds the raw values exactly, so the float64
    # reference over the cache and dense attention over the raw arrays must agree.
    case = AttentionCase("t", "fp16", 64, 6, 2, 4, ((9, 3), (5, 0), (140, 130), (1, 1)), dtype="float16", **kw)
    pr = build_problem(case, 3)
    cache = reference.store_kv(pr.key, pr.value, pr.cache_before, pr.slot_mapping, preset="fp16")
    with np.errstate(all="ignore"):
        ref = reference.paged_attention(pr.query, cache, *pr.attention_args()[1:], **pr.attention_kwargs())
    got = dense_attention(pr.seq_queries, pr.seq_keys, pr.seq_values, scale=case.scale,
                          sliding_window=case.sliding_window, logits_soft_cap=case.logits_soft_cap,
                          sinks=pr.sinks)
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)


def test_measure_and_bounds():
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((5, 3, 8))
    dense[2, 1] = 0.0  # a row without visible keys is left out of the cosine
    d = measure(dense, dense)
    assert d.rel_err == 0.0 and d.mean_cos == pytest.approx(1.0) and d.rows == 14
    noisy = dense + 0.05 * rng.standard_normal(dense.shape)
    d = measure(noisy, dense)
    assert 0.01 < d.rel_err < 0.2 and d.worst.startswith("row [t=")
    bad = dense.copy()
    bad[0, 0, 0] = np.nan
    assert not np.isfinite(measure(bad, dense).rel_err)
    # Bounds are ordered like the formats' fidelity.
    rel = {p: bounds(p, "normal", "bfloat16")[0] for p in
           ("bf16", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")}
    assert rel["bf16"] < rel["turboquant_k8v4"] < rel["turboquant_4bit_nc"] < rel["turboquant_k3v4_nc"] \
        < rel["turboquant_3bit_nc"] < 1.0
    ok, text = within(measure(noisy, dense), "turboquant_3bit_nc", "normal", "bfloat16")
    assert ok and "rel_err" in text
    ok, _ = within(measure(noisy, dense), "bf16", "normal", "bfloat16")
    assert not ok
