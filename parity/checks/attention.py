"""The ``attention`` check: a leg's paged_attention on the reference's cache bytes vs the
float64 reference on the same bytes, once per forced path."""

from __future__ import annotations

from ..legs.base import Leg
from ..report.records import FAILED, PASSED, Record
from ..runner.case_run import CaseRun, attention_metrics, failed_by, timed


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
