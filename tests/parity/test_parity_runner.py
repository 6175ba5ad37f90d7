"""The runner with self-test legs: a correct leg passes, broken legs are caught with a repro
line and a worst element, unavailable legs are skipped (never passed)."""

from __future__ import annotations

import numpy as np
import pytest

from parity.legs import load_leg
from parity.legs.base import Unavailable
from parity.legs.fakes import BrokenLeg, NumpyLeg
from parity.legs.reference import ReferenceLeg
from parity.report.records import FAILED, PASSED, SKIPPED, UNAVAILABLE, final_line, tally
from parity.runner.runner import Options, Runner
from parity_small_cases import CHUNKED, GPU_ONLY, GQA, MODEL, WINDOWED



def run(legs, cases, **kw):
    kw.setdefault("force_auto_choice", True)  # every path by name, plus auto
    return Runner(legs, Options(**kw)).run(cases)


def by_status(records, status):
    return [r for r in records if r.status == status]


def test_numpy_leg_passes_everything():
    recs = run([ReferenceLeg(), NumpyLeg()], [WINDOWED, GQA, CHUNKED, MODEL])
    assert recs and not by_status(recs, FAILED), [r.detail for r in by_status(recs, FAILED)]
    ops = {r.op for r in recs}
    assert {"store", "attention", "paths", "e2e", "chunking", "model"} <= ops
    # Every eligible path was forced, plus auto.
    assert {r.path for r in recs if r.op == "attention"} == {"auto", "decode", "extend", "dequant"}
    # The reference only runs the comparisons that are not vacuous for the oracle.
    assert {r.op for r in recs if r.leg == "reference"} == {"e2e", "chunking"}


def test_two_legs_compare_directly():
    recs = run([NumpyLeg(), BrokenLeg("gqa-modulo")], [GQA])
    cross = [r for r in recs if r.op == "cross"]
    assert len(cross) == 1 and cross[0].status == FAILED and cross[0].leg == "numpy|broken-gqa-modulo"
    inter = [r for r in recs if r.op == "interchange"]
    assert {r.leg for r in inter} == {"numpy->broken-gqa-modulo", "broken-gqa-modulo->numpy"}
    assert {r.leg: r.status for r in inter} == {"numpy->broken-gqa-modulo": FAILED,
                                                "broken-gqa-modulo->numpy": PASSED}


@pytest.mark.parametrize("kind,case,op", [
    ("window-extend", WINDOWED, "attention"),
    ("window-off-by-one", WINDOWED, "attention"),
    ("gqa-modulo", GQA, "attention"),
    ("store-canary", WINDOWED, "store"),
    ("window-off-by-one", CHUNKED, "chunking"),
    ("gqa-modulo", MODEL, "model"),
])
def test_broken_leg_is_caught_with_repro(kind, case, op):
    leg = BrokenLeg(kind)
    recs = run([leg], [case], seed=5, mode="quick")
    failed = [r for r in by_status(recs, FAILED) if r.op == op]
    assert failed, f"{kind} was not caught by {op}: {[(r.op, r.path, r.status) for r in recs]}"
    r = failed[0]
    assert r.repro == f"python -m parity --quick --filter {case.id} --seed 5 --legs {leg.name}"
    assert r.worst  # index, values, error
    if kind == "window-extend":
        # auto resolves to decode for this batch (its 6 queries fit the 3 sequences' decode
        # tiles), which is fine: only the forced extend path fails.
        assert {x.path for x in by_status(recs, FAILED) if x.op == "attention"} == {"extend"}
        assert any(x.op == "paths" for x in by_status(recs, FAILED))


def test_fail_fast_stops_after_first_failing_case():
    recs = run([BrokenLeg("gqa-modulo")], [GQA, WINDOWED], fail_fast=True)
    assert {r.case_id for r in recs} == {GQA.id}


def test_unavailable_leg_is_skipped_never_passed():
    recs = run([NumpyLeg(), Unavailable("torch", "tq_torch not built")], [WINDOWED, MODEL])
    torch_recs = [r for r in recs if "torch" in r.leg]
    assert torch_recs and all(r.status == UNAVAILABLE for r in torch_recs)
    assert all(r.detail == "tq_torch not built" for r in torch_recs)
    # Pair comparisons with the missing leg are unavailable too, and counted as skipped.
    assert {r.op for r in torch_recs} >= {"store", "attention", "e2e", "cross", "interchange", "model"}
    t = tally(recs)
    assert t[SKIPPED] == len(torch_recs) and t[FAILED] == 0
    assert final_line(recs) == f"parity: {t[PASSED]} passed, 0 failed, {t[SKIPPED]} skipped"


def test_leg_lacking_an_op_is_unavailable_for_that_op():
    class StoreOnly(NumpyLeg):
        name = "storeonly"
        ops = ("store_kv",)

    recs = run([StoreOnly()], [WINDOWED])
    assert {r.op: r.status for r in recs if r.op == "store"} == {"store": PASSED}
    att = [r for r in recs if r.op in ("attention", "e2e")]
    assert att and all(r.status == UNAVAILABLE and "paged_attention" in r.detail for r in att)


def test_leg_exception_fails_the_record_not_the_run():
    class Raising(NumpyLeg):
        name = "raising"

        def paged_attention(self, *a, path="auto", **kw):
            if path == "decode":
                raise RuntimeError("kernel launch failed")
            return super().paged_attention(*a, path=path, **kw)

    recs = run([Raising()], [WINDOWED, GQA])
    bad = by_status(recs, FAILED)
    assert bad and all(r.path == "decode" and "kernel launch failed" in r.detail for r in bad if r.op == "attention")
    assert {r.case_id for r in recs} == {WINDOWED.id, GQA.id}


def test_gpu_only_case_skipped_with_reason():
    recs = run([NumpyLeg()], [GPU_ONLY], has_gpu=False)
    assert len(recs) == 1 and recs[0].status == SKIPPED and "gpu-only" in recs[0].detail


def test_kernel_legs_report_unavailable_or_load():
    # Whatever state the kernel packages are in, loading never raises.
    for name in ("torch", "jax"):
        leg = load_leg(name)
        assert leg.name == name and leg.describe()
    with pytest.raises(ValueError, match="unknown leg"):
        load_leg("cuda")


def test_quick_mode_lets_auto_stand_in_for_its_path():
    recs = run([NumpyLeg()], [GQA], force_auto_choice=False)
    # GQA's 3 queries over 2 sequences fit their decode tiles: auto selects decode, so decode is
    # not forced again; extend and dequant (eligible for its bfloat16 query) still are.
    assert {r.path for r in recs if r.op == "attention"} == {"auto", "extend", "dequant"}
    assert np.isfinite([r.metrics.get("max_err", 0.0) for r in recs]).all()


def test_interrupt_keeps_finished_cases():
    class Interrupting(NumpyLeg):
        name = "interrupting"

        def store_kv(self, key, value, kv_cache, slot_mapping, **kw):
            if key.shape[0] > 20:  # WINDOWED has more stored rows than GQA
                raise KeyboardInterrupt
            return super().store_kv(key, value, kv_cache, slot_mapping, **kw)

    runner = Runner([Interrupting()], Options())
    recs = runner.run([GQA, WINDOWED, CHUNKED])
    assert {r.case_id for r in recs} == {GQA.id}
    assert runner.interrupted == "interrupted: 1 of 3 case(s) ran; the rest did not"
