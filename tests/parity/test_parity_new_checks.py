"""Issue 14's catalog additions and checks, with self-test legs (fast, no kernels).

Known failures (strict xfail), forced decode split counts, determinism, padding rows, NaN
propagation in the comparisons, the new data modes, and the cuda-graph check's skip on CPU.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import tq_spec
from parity.catalog.cases import AttentionCase
from parity.catalog.catalog import build_catalog
from parity.catalog.problem import FP8_SATURATING, build_problem
from parity.legs.fakes import BrokenLeg, NumpyLeg
from parity.legs.reference import ReferenceLeg
from parity.report.records import FAILED, PASSED, SKIPPED, XFAILED, final_line
from parity.report.report import console_report, markdown
from parity.runner.runner import Options, Runner
from parity_small_cases import WINDOWED

NEW_GROUPS = ("key-ties", "fp8-saturate", "value-lanes", "splits", "sinks", "softcap-small", "nan-propagation",
              "padding", "cuda-graph")


def run(legs, cases, **kw):
    return Runner(legs, Options(**kw)).run(cases)


@pytest.fixture(scope="module")
def quick():
    return build_catalog("quick", 0)


def test_new_groups_are_in_quick_and_full(quick):
    full = build_catalog("full", 0)
    for group in NEW_GROUPS:
        assert any(c.group == group for c in quick), group
        assert any(c.group == group for c in full), group
    cg = [c for c in quick if c.group == "cuda-graph"]
    assert cg and all(c.gpu_only and c.checks == ("cuda-graph",) for c in cg)


def test_new_quick_cases_pass_with_the_numpy_leg(quick):
    cases = [c for c in quick if c.group in NEW_GROUPS and not c.gpu_only]
    recs = run([ReferenceLeg(), NumpyLeg()], cases)
    bad = [r for r in recs if r.status == FAILED]
    assert not bad, "\n".join(f"{r.case_id} {r.op} {r.path}: {r.detail[:300]}" for r in bad)
    paths = {r.path for r in recs if r.op == "attention"}
    assert {"decode/splits=1", "decode/splits=9"} <= paths
    assert {r.op for r in recs} >= {"attention", "store", "determinism", "paths", "cross"} - {"cross"}


def test_known_failure_is_xfailed_and_a_pass_is_an_xpass():
    broken = dataclasses.replace(WINDOWED, known=(("broken-window-off-by-one", "pretend reason"),))
    recs = run([BrokenLeg("window-off-by-one")], [broken])
    assert not [r for r in recs if r.status == FAILED]
    xf = [r for r in recs if r.status == XFAILED]
    assert xf and all(r.metrics["known"] == "pretend reason" for r in xf)
    assert "known failures (xfailed)" in final_line(recs)
    text = console_report(recs, ["x"])
    assert "known failure: pretend reason" in text
    md = markdown(recs, {"mode": "quick"})
    assert "## Known failures" in md and "xfailed |" in md
    fine = dataclasses.replace(WINDOWED, known=(("numpy", "pretend reason"),))
    recs = run([NumpyLeg()], [fine])
    xpass = [r for r in recs if r.status == FAILED]
    assert len(xpass) == 1 and xpass[0].detail.startswith("xpassed")


def test_padding_rows_are_nan_queries_and_must_come_back_zero():
    case = AttentionCase("t", "bf16", 64, 4, 2, 16, ((9, 1), (0, 0), (5, 2)), pad_rows=3,
                         checks=("attention", "paths"))
    pr = build_problem(case, 0)
    assert pr.query.shape[0] == 6 and np.isnan(pr.query[3:].astype(np.float32)).all()
    assert case.num_tokens == 6
    recs = run([NumpyLeg()], [case])
    assert recs and all(r.status == PASSED for r in recs), [r.detail for r in recs]


class _LeaksPadding(NumpyLeg):
    """Computes the padding rows (here: copies the query) instead of returning zeros."""

    name = "leaks-padding"

    def paged_attention(self, query, kv_cache, block_table, seq_lens, query_start_loc, **kw):
        out = super().paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, **kw)
        out[int(query_start_loc[-1]):] = query[int(query_start_loc[-1]):]
        return out


def test_a_leg_that_leaks_padding_rows_fails():
    case = AttentionCase("t", "bf16", 64, 4, 2, 16, ((9, 1), (5, 2)), pad_rows=2, checks=("attention",))
    recs = run([_LeaksPadding()], [case])
    assert any(r.status == FAILED and r.op == "attention" for r in recs)


class _EatsNaN(NumpyLeg):
    """Turns NaN rows into zeros (the bug tq_torch had for NaN queries)."""

    name = "eats-nan"

    def paged_attention(self, *a, **kw):
        out = super().paged_attention(*a, **kw)
        return np.where(np.isnan(out.astype(np.float32)), 0, out).astype(out.dtype)


@pytest.mark.parametrize("data,sinks", [("nan-query", False), ("nan-sinks", True)])
def test_nan_propagation_is_required(data, sinks):
    case = AttentionCase("t", "turboquant_k8v4", 64, 4, 2, 16, ((9, 3), (14, 1)), data=data, sinks=sinks,
                         checks=("attention", "paths", "cross"))
    pr = build_problem(case, 0)
    from tq_spec import reference

    with np.errstate(all="ignore"):  # NaN/Inf propagating is the point
        ref = reference.paged_attention(pr.query, pr.hide(reference.store_kv(pr.key, pr.value, pr.cache_before,
                                                                            pr.slot_mapping, **pr.store_kwargs())),
                                        *pr.attention_args()[1:], **pr.attention_kwargs())
    assert np.isnan(ref).any() and np.isfinite(ref).any()  # the case has NaN rows and finite rows
    assert all(r.status == PASSED for r in run([NumpyLeg()], [case]))
    recs = run([_EatsNaN()], [case])
    bad = [r for r in recs if r.status == FAILED and r.op == "attention"]
    assert bad and "NaN/Inf" in bad[0].detail
    both = run([NumpyLeg(), _EatsNaN()], [case])
    assert any(r.op == "cross" and r.status == FAILED for r in both)


def test_fp8_saturate_keys_hit_the_clamp():
    case = AttentionCase("t", "turboquant_k8v4", 64, 4, 2, 16, ((12, 2), (7, 1)), dtype="float32",
                         data="fp8-saturate", checks=("store", "attention"))
    pr = build_problem(case, 0)
    k = np.concatenate(pr.seq_keys).astype(np.float32)
    for v in (448.0, 464.0, np.inf, -np.inf):
        assert (k == v).any(), v
    assert set(np.unique(k[np.abs(k) >= 440])) <= set(FP8_SATURATING.tolist())
    from tq_spec import reference

    cache = reference.store_kv(pr.key, pr.value, pr.cache_before, pr.slot_mapping, **pr.store_kwargs())
    k8 = cache[..., :64][np.isin(cache[..., :64], [0x7E, 0xFE])]
    assert k8.size  # +-448 (0x7E / 0xFE): infinities and overflow saturate, never NaN (0x7F)


def test_key_ties_sit_on_boundaries():
    from tq_spec.quantize import encode_slots
    from tq_spec.params import quant_params

    for preset in ("turboquant_3bit_nc", "turboquant_k8v4"):
        case = AttentionCase("t", preset, 64, 4, 2, 16, ((17, 3),), dtype="float32", data="key-ties",
                             checks=("store",))
        pr = build_problem(case, 0)
        k = pr.seq_keys[0].astype(np.float32)
        v = pr.seq_values[0].astype(np.float32)
        params = quant_params(preset, 64)
        _, det = encode_slots(k, v, params, details=True)
        pos = det.value_position
        on_tie = np.abs(pos - np.round(pos)) <= 1e-6 * np.maximum(1, np.abs(pos))
        assert on_tie.mean() > 0.5  # most value lanes on (or one ulp off) a half step
        if preset == "turboquant_k8v4":
            a = np.abs(k[k != 0]).astype(np.float64)
            e = np.floor(np.log2(a)).astype(np.int64)
            quantum = np.ldexp(1.0, np.maximum(e, -6) - 3)
            frac = a / quantum - np.floor(a / quantum)
            assert (np.abs(frac - 0.5) < 1e-5).mean() > 0.9  # on (or a float32 ulp off) fp8 midpoints
        else:
            y = det.key_rotated
            mid = params.codebook.midpoints.astype(np.float64)
            dist = np.min(np.abs(y[..., None] - mid), axis=-1)
            assert (dist <= 1e-6).mean() > 0.25  # a third of the coordinates in the boundary band


def test_value_lanes_put_extremes_last_and_constants():
    case = AttentionCase("t", "turboquant_k8v4", 96, 4, 2, 16, ((40, 2),), dtype="float32", data="value-lanes",
                         checks=("store",))
    v = build_problem(case, 0).seq_values[0].astype(np.float32)
    arg_max, arg_min = v.argmax(-1), v.argmin(-1)
    assert ((arg_max >= 93) | (arg_min >= 93)).mean() > 0.3
    assert (v.max(-1) == v.min(-1)).any()  # constant vectors


def test_cuda_graph_check_is_skipped_without_a_gpu(quick):
    cg = next(c for c in quick if c.group == "cuda-graph")
    recs = run([NumpyLeg()], [cg])
    assert all(r.status == SKIPPED for r in recs)
    from parity.checks.cuda_graph import seq_len_variants

    got = seq_len_variants(np.array([300, 77, 1, 0]), np.array([1, 1, 1, 0]))
    assert [g.tolist() for g in got] == [[300, 77, 1, 0], [150, 38, 1, 0], [1, 1, 1, 0], [300, 77, 1, 0]]


def test_determinism_catches_a_nondeterministic_leg():
    class Flaky(NumpyLeg):
        name = "flaky"
        calls = 0

        def paged_attention(self, *a, **kw):
            out = super().paged_attention(*a, **kw)
            Flaky.calls += 1
            out = out.copy()
            out.reshape(-1)[0] += np.float32(Flaky.calls * 1e-6)  # a different last bit on every call
            return out

    case = AttentionCase("t", "bf16", 64, 4, 2, 16, ((9, 1), (5, 2)), dtype="float32",
                         checks=("attention", "determinism"))
    recs = run([Flaky()], [case])
    assert any(r.op == "determinism" and r.status == FAILED for r in recs)
    recs = run([NumpyLeg()], [case])
    det = [r for r in recs if r.op == "determinism"]
    assert det and all(r.status == PASSED for r in det)


def test_store_determinism_and_splits_paths_with_numpy():
    case = AttentionCase("t", "turboquant_4bit_nc", 64, 4, 2, 16, ((40, 1), (3, 1)), decode_splits=(1, 64),
                         checks=("store", "attention", "determinism"))
    recs = run([NumpyLeg()], [case])
    assert {r.path for r in recs if r.op == "determinism"} >= {"store", "decode/splits=1", "decode/splits=64"}
    assert all(r.status == PASSED for r in recs)


def test_case_field_validation():
    with pytest.raises(ValueError, match="e2e"):
        AttentionCase("t", "bf16", 64, 4, 2, 16, ((9, 1),), data="nan-query")
    with pytest.raises(ValueError, match="pad_rows"):
        AttentionCase("t", "bf16", 64, 4, 2, 16, ((9, 1),), pad_rows=2)  # default checks include e2e
    assert tq_spec.layout("turboquant_k8v4", 80).slot_bytes > 0
