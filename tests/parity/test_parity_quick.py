"""The parity catalog as a test: quick on every machine (CI: interpreters), full with ``-m gpu``.

Equivalent to ``python -m parity --quick`` / ``--full`` with all three legs (and the same
worker processes: `parity.runner.parallel.default_jobs`), except the ``errors`` group: its bad-input
rows run once, as tests/test_bad_inputs.py (one test per row and leg, with strict xfail marks). A kernel leg that
cannot be loaded fails these tests (with the reason): in this repository both kernel packages
are part of the product, so "unavailable" here means broken, not optional.
"""

from __future__ import annotations

import pytest

from parity.runner import environment
from parity.catalog.catalog import build_catalog
from parity.legs import LEG_NAMES, Unavailable, load_leg
from parity.report.records import FAILED, final_line
from parity.report.report import failure_text, summary_table
from parity.runner.parallel import default_jobs, run_cases
from parity.runner.runner import Options


def _run(mode: str):
    has_gpu = environment.configure()
    legs = [load_leg(n) for n in LEG_NAMES]
    missing = [leg.describe() for leg in legs if isinstance(leg, Unavailable)]
    assert not missing, "legs unavailable: " + "; ".join(missing)
    cases = [c for c in build_catalog(mode, 0) if c.group != "errors"]
    records, interrupted = run_cases(LEG_NAMES, Options(mode=mode, seed=0, has_gpu=has_gpu),
                                     cases, default_jobs(has_gpu), legs=legs)
    assert not interrupted
    print(summary_table(records))
    print(final_line(records))
    failures = [r for r in records if r.status == FAILED]
    assert not failures, "\n".join(failure_text(r) for r in failures)
    assert any(r.status == "passed" for r in records)


def test_parity_quick_catalog():
    _run("quick")


@pytest.mark.gpu
def test_parity_full_catalog():
    _run("full")
