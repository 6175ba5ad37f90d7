"""`--jobs N`: worker processes give the serial runner's records, stop on failure with
--fail-fast, and turn a dying worker into failed records instead of a hang or a pass."""

from __future__ import annotations

import dataclasses
import os

from parity.catalog.cases import AttentionCase
from parity.runner.parallel import cost_order, run_parallel
from parity.report.records import FAILED, PASSED
from parity.legs import load_leg
from parity.runner.runner import Options, Runner
from parity_small_cases import CHUNKED, GQA, WINDOWED

LEGS = ("reference", "numpy", "broken-gqa-modulo")


def _comparable(records):
    return [{k: v for k, v in r.to_json().items() if k != "seconds"} for r in records]


def test_parallel_records_equal_serial_records_in_catalog_order():
    cases = [WINDOWED, GQA, CHUNKED]
    serial = Runner([load_leg(n) for n in LEGS], Options(seed=5)).run(cases)
    seen = []
    parallel, interrupted = run_parallel(LEGS, Options(seed=5), cases, jobs=2,
                                         on_case=lambda done, total, case, recs, s: seen.append((done, total)))
    assert interrupted == ""
    assert _comparable(parallel) == _comparable(serial)
    assert sorted(seen) == [(1, 3), (2, 3), (3, 3)]
    assert any(r.status == FAILED and r.repro for r in parallel)  # broken-gqa-modulo is caught
    assert any(r.status == PASSED for r in parallel)


def test_cost_order_starts_the_heavy_cases_first():
    far = dataclasses.replace(GQA, far_pages=True, gpu_only=True)
    assert cost_order([GQA, CHUNKED, far]) == [2, 1, 0]


def test_fail_fast_drops_the_queued_cases():
    cases = [dataclasses.replace(GQA, seqs=((7 + i, 2), (5, 1))) for i in range(12)]
    records, interrupted = run_parallel(("broken-gqa-modulo",), Options(fail_fast=True), cases, jobs=2)
    ran = {r.case_id for r in records}
    assert any(r.status == FAILED for r in records)
    assert 1 <= len(ran) < len(cases) and interrupted == ""


class _KillsItsWorker(AttentionCase):
    """A case whose unpickling in the worker ends that process, like a kernel segfault would."""

    def __reduce__(self):
        return os._exit, (3,)


def test_a_dying_worker_fails_its_cases():
    crash = _KillsItsWorker("crash", "bf16", 64, 2, 1, 16, ((3, 1),))
    records, interrupted = run_parallel(("numpy",), Options(), [crash], jobs=2)
    assert interrupted == ""
    assert [(r.case_id, r.status) for r in records] == [(crash.id, FAILED)]
    assert "worker process died" in records[0].detail
