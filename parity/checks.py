"""Single-leg comparisons of one attention case (DESIGN.md section 5).

Each ``check_*`` function runs one comparison on a `CaseRun` and returns
`Record`s; pair comparisons live in `parity.pair_checks`, chunking in
`parity.chunking`. All comparisons of the suite:

  store        leg store_kv bytes vs the reference (`parity.tolerances.compare_store`).
  attention    leg paged_attention on the reference's cache bytes vs the float64
               reference on the same bytes (`check_attention`), per forced path.
  paths        every path of a leg agrees with every other within their bounds.
  e2e          leg store then leg attention vs dense float64 attention on raw K/V,
               within the preset's expected distortion (`parity.distortion`).
  cross        torch vs jax attention outputs directly (sum of their bounds).
  cross-store  torch vs jax cache bytes: codes may differ only where each is
               within tolerance of the reference; fp fields equal (1 ulp on the
               fp16 key norm, whose fp32 sum order is implementation-defined, and
               on fp8 under the Triton interpreter).
  interchange  cache written by one leg, read by another, vs the reference on those bytes.
  chunking     the same tokens stored and attended in chunks == one prefill.
"""

from __future__ import annotations

import numpy as np

from . import distortion, tolerances
from .case_run import CaseRun, attention_metrics, failed_by, timed
from .legs.base import Leg
from .records import FAILED, PASSED, Record


def check_store(run: CaseRun, leg: Leg) -> list[Record]:
    """Leg store bytes vs the reference (boundary-only code mismatches, <= 1 ulp fields, canaries)."""
    def go():
        pr = run.problem
        try:
            got = run.store(leg)
            first = pr.batch.first_used_page
            if first:
                # Far-offset caches: pages below the first used one must be untouched;
                # the comparison itself runs on the used tail (cheaper, same slots).
                if not _equal_chunked(got[:first], pr.cache_before[:first]):
                    return run.record("store", leg.name, "-", FAILED,
                                      f"canary: bytes of never-used pages [0, {first}) changed")
                sm = pr.slot_mapping.astype(np.int64)
                sm = np.where(sm >= 0, sm - first * pr.case.block_size, -1)
                cmp = tolerances.compare_store(got[first:], pr.key, pr.value, pr.cache_before[first:], sm,
                                               **pr.store_kwargs())
            else:
                cmp = tolerances.compare_store(got, pr.key, pr.value, pr.cache_before, pr.slot_mapping,
                                               **pr.store_kwargs())
        except Exception as e:
            return failed_by(run, "store", leg.name, "-", e)
        return run.record("store", leg.name, "-", PASSED if cmp.ok else FAILED, cmp.describe(),
                          metrics={"agreement": cmp.agreement, "slots_written": cmp.slots_written},
                          worst="" if cmp.ok else "; ".join(cmp.problems))
    return timed(go)


def _equal_chunked(a: np.ndarray, b: np.ndarray, rows: int = 4096) -> bool:
    for i in range(0, a.shape[0], rows):
        if not np.array_equal(a[i:i + rows], b[i:i + rows]):
            return False
    return True


def check_attention(run: CaseRun, leg: Leg, paths) -> list[Record]:
    """Leg attention (each forced path) on the reference's cache bytes vs the reference."""
    records = []
    outs = run.outputs.setdefault(leg.name, {})
    dev_cache = None
    for path in paths:
        def go(path=path):
            nonlocal dev_cache
            try:
                if dev_cache is None:
                    dev_cache = leg.put(run.attn_cache)
                out = run.attend(leg, dev_cache, path)
                cmp = run.compare(leg, out, run.attn_cache, run.ref_out)
            except Exception as e:
                return failed_by(run, "attention", leg.name, path, e)
            outs[path] = (out, cmp)
            return run.record("attention", leg.name, path, PASSED if cmp.ok else FAILED, cmp.describe(),
                              metrics=attention_metrics(cmp), worst="" if cmp.ok else cmp.worst)
        records += timed(go)
    return records


def max_diff(a: np.ndarray, b: np.ndarray) -> tuple[float, str]:
    x = tolerances.to_numpy(a).astype(np.float64)
    y = tolerances.to_numpy(b).astype(np.float64)
    if x.shape != y.shape:
        return float("inf"), f"shapes {x.shape} vs {y.shape}"
    if x.size == 0:
        return 0.0, "empty"
    d = np.abs(x - y)
    d = np.where(np.isnan(d), np.inf, d)
    i = np.unravel_index(int(np.argmax(d)), d.shape)
    return float(d[i]), f"[t={i[0]}, h={i[1]}, d={i[2]}]: {float(x[i]):.7g} vs {float(y[i]):.7g}"


def check_paths(run: CaseRun, leg: Leg) -> list[Record]:
    """Path invariance: every pair of paths within the sum of their bounds."""
    outs = run.outputs.get(leg.name, {})
    if len(outs) < 2:
        return []

    def go():
        names = sorted(outs)
        worst_ratio, worst_text, largest = -1.0, "", 0.0
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                diff, where = max_diff(outs[a][0], outs[b][0])
                allowed = outs[a][1].bound + outs[b][1].bound
                largest = max(largest, diff)
                ratio = diff / allowed if allowed > 0 else (0.0 if diff == 0 else float("inf"))
                if ratio > worst_ratio:
                    worst_ratio = ratio
                    worst_text = f"{a} vs {b} {where} (diff {diff:.3e}, allowed {allowed:.3e})"
        ok = worst_ratio <= 1.0
        detail = (f"{len(names)} paths agree; worst pair {worst_text}" if ok else f"paths disagree: {worst_text}")
        return run.record("paths", leg.name, "+".join(names), PASSED if ok else FAILED, detail,
                          metrics={"max_diff": largest, "worst_ratio": worst_ratio},
                          worst="" if ok else worst_text)
    return timed(go)


def check_e2e(run: CaseRun, leg: Leg) -> list[Record]:
    """Leg store then leg attention (auto) vs dense float64 attention on the raw K/V."""
    def go():
        c = run.case
        try:
            if leg.oracle:
                out = run.ref_out
            else:
                cache = run.problem.hide(run.store(leg))
                out, _ = run.auto_output(leg, cache)
            d = distortion.measure(tolerances.to_numpy(out), run.dense)
            ok, text = distortion.within(d, c.preset, c.data, c.dtype)
        except Exception as e:
            return failed_by(run, "e2e", leg.name, "auto", e)
        return run.record("e2e", leg.name, "auto", PASSED if ok else FAILED, text, metrics=d.to_dict(),
                          worst="" if ok else d.worst)
    return timed(go)
