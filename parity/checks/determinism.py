"""The ``determinism`` check: the same inputs twice through one leg give identical bytes.

A store is run a second time from the same cache and inputs and must write the same bytes; every
attention path the ``attention`` check ran is run again on the same cache and must return the same
output, bit for bit (NaN payloads included). Split-KV merges, atomics or uninitialised scratch
that made results depend on scheduling would show here; no tolerance applies.
"""

from __future__ import annotations

import numpy as np

from ..legs.base import Leg
from ..report.records import FAILED, PASSED, Record
from ..runner.case_run import CaseRun, LegError, failed_by, timed


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}")) if a.dtype.kind == "f" or str(a.dtype) == "bfloat16" else a


def _first_difference(a: np.ndarray, b: np.ndarray) -> str:
    ba, bb = _bits(a), _bits(b)
    diff = ba != bb
    i = tuple(int(x) for x in np.argwhere(diff)[0])
    return f"{int(diff.sum())} elements differ; first at {list(i)}: {a[i]!r} vs {b[i]!r}"


def check_determinism(run: CaseRun, leg: Leg) -> list[Record]:
    """The leg's store and each attention path it ran, repeated: identical results."""
    records = []
    if "store_kv" in leg.ops and "store" in run.case.checks:
        def store_again():
            pr = run.problem
            try:
                first = run.store(leg)
                again = leg.get(leg.store_kv(leg.put(pr.key), leg.put(pr.value), leg.put(pr.cache_before),
                                             leg.put(pr.slot_mapping), **pr.store_kwargs()))
            except Exception as e:
                return failed_by(run, "determinism", leg.name, "store", LegError(f"{leg.name}.store_kv", e))
            if np.array_equal(first, again):
                return run.record("determinism", leg.name, "store", PASSED, "two stores wrote identical bytes")
            why = _first_difference(first, again)
            return run.record("determinism", leg.name, "store", FAILED, f"two stores differ: {why}", worst=why)
        records += timed(store_again)
    outs = run.outputs.get(leg.name, {})
    for path in sorted(outs):
        def attend_again(path=path):
            first = outs[path][0]
            try:
                again = run.attend(leg, run.attn_cache, path)
            except Exception as e:
                return failed_by(run, "determinism", leg.name, path, e)
            if first.shape == again.shape and np.array_equal(_bits(first), _bits(again)):
                return run.record("determinism", leg.name, path, PASSED, "two calls returned identical outputs")
            why = _first_difference(first, again) if first.shape == again.shape else (
                f"shapes {first.shape} vs {again.shape}")
            return run.record("determinism", leg.name, path, FAILED, f"two calls differ: {why}", worst=why)
        records += timed(attend_again)
    return records
