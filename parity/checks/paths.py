"""The ``paths`` check (path invariance: every forced path of a leg agrees with every other
within the sum of their bounds), and `max_diff`, shared by the checks that compare two outputs."""

from __future__ import annotations

import numpy as np

from .. import tolerances
from ..legs.base import Leg
from ..report.records import FAILED, PASSED, Record
from ..runner.case_run import CaseRun, timed


def max_diff(a: np.ndarray, b: np.ndarray) -> tuple[float, str]:
    x = tolerances.to_numpy(a).astype(np.float64)
    y = tolerances.to_numpy(b).astype(np.float64)
    if x.shape != y.shape:
        return float("inf"), f"shapes {x.shape} vs {y.shape}"
    if x.size == 0:
        return 0.0, "empty"
    d = np.abs(x - y)
    # The same NaN or Inf on both sides (a visible NaN input propagating) is agreement, not a difference.
    same = (np.isnan(x) & np.isnan(y)) | (np.isinf(x) & (x == y))
    d = np.where(same, 0.0, np.where(np.isnan(d), np.inf, d))
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
