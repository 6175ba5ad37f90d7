"""The ``store`` check: a leg's store_kv bytes vs the reference (`parity.tolerances.compare_store`)."""

from __future__ import annotations

import numpy as np

from .. import tolerances
from ..legs.base import Leg
from ..report.records import FAILED, PASSED, Record
from ..runner.case_run import CaseRun, failed_by, timed


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
