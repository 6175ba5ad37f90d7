"""Every bad-input class of issue 14, scripted: parity/catalog/bad_inputs.py through both frameworks.

One test per (row, leg) and one per row for torch|jax agreement, running the same code as
``python -m parity``'s ``errors`` op (`parity.checks.errors`): with ``validate=True`` each leg raises
the reference's exception class naming the same argument; with ``validate=False`` a metadata error
neither crashes (the calls run in a child process) nor writes outside the cache or the output
(canary guards), nor disturbs the rows of untouched sequences. Rows a leg is known to fail carry
``xfail(strict=True)`` with the reason (`parity.catalog.bad_inputs.KNOWN`), so a fix shows as an
XPASS failure until the mark is removed.

The quick parity catalog test (tests/parity/test_parity_quick.py) leaves the ``errors`` group to
this module, so CI runs each row once.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity.catalog.bad_inputs import BASE_PRESET, KINDS, LEGS, PAIR, bad_inputs, base_problem
from parity.checks import errors
from parity.report.records import FAILED, PASSED
from parity.runner import environment

ROWS = bad_inputs()


class KnownFailure(AssertionError):
    """A failure the row's `known` entry covers (the only exception its xfail mark accepts)."""


def _params():
    out = []
    for row in ROWS:
        for leg in row.legs + ((PAIR,) if len(row.legs) == 2 else ()):
            reasons = sorted({f"{where}: {reason}" for k_leg, where, reason in row.known if k_leg == leg})
            marks = ([pytest.mark.xfail(strict=True, raises=KnownFailure, reason="; ".join(reasons))]
                     if reasons else [])
            out.append(pytest.param(row, leg, marks=marks, id=f"{row.id}[{leg}]"))
    return out


@pytest.fixture(scope="module")
def runner():
    environment.configure()
    r = errors.ErrorsRunner(0)
    r.results = {}
    yield r
    r.close()


def _records(runner, row):
    if row.id not in runner.results:
        runner.results[row.id] = errors.check_errors(row, list(LEGS), runner, f"errors:{row.id}", BASE_PRESET,
                                                     apply_known=False)
    return runner.results[row.id]


@pytest.mark.parametrize("row,leg", _params())
def test_bad_input(runner, row, leg):
    recs = [r for r in _records(runner, row) if r.leg == leg]
    assert recs, f"no records for {leg}"
    # A failure no `known` entry covers fails the test even under the xfail mark (raises=KnownFailure).
    bad = [r for r in recs if r.status != PASSED and not row.known_reason(leg, r.path)]
    assert not bad, "\n".join(f"{r.path}: {r.detail}" for r in bad)
    known = [r for r in recs if r.status != PASSED]
    if known:
        raise KnownFailure("\n".join(f"{r.path}: {r.detail}" for r in known))


def test_the_issue_classes_are_all_there():
    ids = {r.id for r in ROWS}
    assert len([r for r in ROWS if r.kind != "valid"]) >= 76
    assert {r.kind for r in ROWS} == set(KINDS)
    for name in ("store/slot-eq-NP", "store/slot-2pow40", "store/slot-m2", "store/slot-duplicate",
                 "attention/block-id-eq-N", "attention/block-id-m1", "attention/block-id-1e6",
                 "attention/seq-len-past-capacity", "attention/seq-len-negative", "attention/q-len-past-seq-len",
                 "attention/qsl-decreasing", "attention/qsl-not-from-0", "attention/qsl-past-T",
                 "attention/torch-query-to-jax", "store/torch-key-to-jax", "attention/padding-rows",
                 "attention/empty-request"):
        assert name in ids, name
    # Argument errors cover every kind of argument the issue lists.
    args = {r.name.split("-")[0] for r in ROWS if r.kind == "argument"}
    assert {"key", "value", "cache", "slots", "preset", "query", "scale", "window", "softcap", "sinks",
            "rotation", "path", "validate"} <= args


def test_base_problem_is_valid_and_deterministic():
    from tq_spec import reference

    a, b = base_problem(0), base_problem(0)
    np.testing.assert_array_equal(a.attention["kv_cache"], b.attention["kv_cache"])
    out = reference.paged_attention(**a.attention)
    assert np.isfinite(out).all() and out.shape == a.attention["query"].shape
    reference.store_kv(**a.store)


# ---------------------------------------------------------------- the detectors themselves


def test_store_safety_catches_a_write_into_another_slot():
    base = base_problem(0)
    kw = dict(base.store)
    kw["slot_mapping"] = kw["slot_mapping"].copy()
    kw["slot_mapping"][1] = base.n_slots  # out of range: must not be written
    from tq_spec import reference

    clean = kw["slot_mapping"].copy()
    clean[1] = -1
    good = reference.store_kv(kw["key"], kw["value"], kw["kv_cache"], clean, preset=kw["preset"])
    ok, detail, _ = errors._store_safe(good, kw)
    assert ok, detail
    # The bug tq_jax once had: the out-of-range token written into a different (clamped) slot.
    wrong = good.copy()
    wrong[-1, -1] = reference.store_kv(kw["key"][1:2], kw["value"][1:2], kw["kv_cache"],
                                       np.array([base.n_slots - 1]), preset=kw["preset"])[-1, -1]
    ok, detail, _ = errors._store_safe(wrong, kw)
    assert not ok and "canary" in detail


def test_torch_guards_catch_writes_and_reads_outside_the_cache(monkeypatch):
    environment.configure()
    import torch

    import tq_torch

    row = next(r for r in ROWS if r.id == "attention/block-id-eq-N")
    kw = row.call_kwargs(base_problem(0))
    kw["validate"] = False

    def writes_past_the_end(query, kv_cache, *a, out=None, **k):
        whole = torch.as_strided(kv_cache, (kv_cache.numel() + 64,), (1,), kv_cache.storage_offset())
        whole[-1] = 0  # one byte past the cache: in the guard
        return out

    monkeypatch.setattr(tq_torch, "paged_attention", writes_past_the_end)
    got = errors._run_torch(row, kw)
    assert any("bytes after the cache changed" in p for p in got["problems"]), got["problems"]

    def reads_past_the_end(query, kv_cache, *a, out=None, **k):
        whole = torch.as_strided(kv_cache, (kv_cache.numel() + 64,), (1,), kv_cache.storage_offset())
        out.fill_(float(whole[-1]))
        return out

    monkeypatch.setattr(tq_torch, "paged_attention", reads_past_the_end)
    got = errors._run_torch(row, kw)
    assert any("read outside the cache" in p for p in got["problems"]), got["problems"]

    def writes_past_out(query, kv_cache, *a, out=None, **k):
        whole = torch.as_strided(out, (out.numel() + 1,), (1,), out.storage_offset())
        whole.fill_(0.0)
        return out

    monkeypatch.setattr(tq_torch, "paged_attention", writes_past_out)
    got = errors._run_torch(row, kw)
    assert any("out='s guard rows changed" in p for p in got["problems"]), got["problems"]


def test_sandbox_survives_crashes_and_hangs():
    from parity.runner.sandbox import Sandbox

    sb = Sandbox("parity.runner.sandbox:selftest", timeout=20)
    try:
        assert sb.call({"do": "echo", "value": 1})["echo"] == 1
        assert sb.call({"do": "print"}) == {"printed": True}  # stray stdout does not break the protocol
        assert "SIGSEGV" in sb.call({"do": "segv"})["crashed"]
        assert sb.call({"do": "echo", "value": 2})["echo"] == 2  # a fresh child
        assert "exit code 7" in sb.call({"do": "exit", "code": 7})["crashed"]
        assert "asked to raise" in sb.call({"do": "raise"})["harness"]
        sb.timeout = 1
        assert "no answer within" in sb.call({"do": "sleep", "seconds": 30})["crashed"]
    finally:
        sb.close()


def test_pair_rule():
    a = {"raised": None, "result": np.array([[1.0, np.nan]], np.float32)}
    b = {"raised": None, "result": np.array([[1.0 + 1e-6, np.nan]], np.float32)}
    assert errors._pair(a, b)[0] is True
    c = {"raised": None, "result": np.array([[1.0, 0.0]], np.float32)}
    assert errors._pair(a, c)[0] is False  # NaN in one leg only
    e1 = {"raised": ("ValueError", "path", "")}
    e2 = {"raised": ("TypeError", "path", "")}
    assert errors._pair(e1, e2)[0] is False
    assert errors._pair(e1, dict(e1))[0] is True


def test_records_of_known_failures(monkeypatch):
    """In the parity run a known failure is xfailed, and a known failure that passes is a failure."""
    from dataclasses import replace

    from parity.report.records import XFAILED

    row = replace(next(r for r in ROWS if r.id == "store/key-int32"),
                  known=(("torch", "*", "pretend"), ("jax", "*", "pretend")))
    r = errors._record(row, "c", "p", "torch", "validated:auto", True, "fine", "", "pretend", 0.0, ("torch",))
    assert r.status == FAILED and r.detail.startswith("xpassed")
    r = errors._record(row, "c", "p", "torch", "validated:auto", False, "broken", "", "pretend", 0.0, ("torch",))
    assert r.status == XFAILED and r.metrics["known"] == "pretend"


def test_store_safety_allows_any_bytes_in_a_duplicated_slot_only():
    from tq_spec import reference

    base = base_problem(0)
    kw = dict(base.store)
    sm = kw["slot_mapping"].copy()
    sm[1] = sm[0]  # slot named twice: its bytes are unspecified (a race)
    kw["slot_mapping"] = sm
    one = sm.copy()
    one[1] = -1
    got = reference.store_kv(kw["key"], kw["value"], kw["kv_cache"], one, preset=kw["preset"])
    p = got.shape[1]
    s = int(sm[0])
    torn = got.copy()
    torn[s // p, s % p, :, :8] ^= 0x5A  # a torn mix of the two tokens
    ok, detail, _ = errors._store_safe(torn, kw)
    assert ok and "torn" in detail, detail
    other = got.copy()
    free = int(base.store["slot_mapping"][3]) + 1  # a slot nobody names
    other[free // p, free % p, 0, 0] ^= 0x01
    ok, detail, _ = errors._store_safe(other, kw)
    assert not ok and "canary" in detail, detail
