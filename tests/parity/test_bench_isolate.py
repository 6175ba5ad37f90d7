"""`parity.bench.isolate`: the children's arguments and the merge of their runs (no GPU needed)."""

from __future__ import annotations

from parity.bench.isolate import child_argv, merge_runs


def test_child_argv_drops_the_parents_outputs_and_legs():
    argv = ["--quick", "--legs", "torch,jax", "--out", "docs/bench", "--benchmarks-md=BENCHMARKS.md",
            "--compare-json", "docs/bench/baseline", "--label", "x y", "--filter", "decode"]
    assert child_argv(argv, "jax", "/tmp/j") == [
        "--quick", "--label", "x y", "--filter", "decode", "--legs", "jax", "--out", "/tmp/j"]


def _doc(env, rows, notes=()):
    return {"environment": env, "roofline": {"gbps": 1.0}, "rows": rows, "notes": list(notes)}


def test_merge_keeps_each_baseline_from_the_first_process_that_has_it():
    torch_run = _doc({"torch": "2.11", "jax": "not imported", "command": "c1", "label": "l"},
                     [{"row": "r", "leg": "sdpa", "time_ms": 1.0}, {"row": "r", "leg": "torch", "time_ms": 2.0}],
                     ["n1"])
    jax_run = _doc({"torch": "2.11", "jax": "0.11", "command": "c2", "label": "l"},
                   [{"row": "r", "leg": "sdpa", "time_ms": 9.0}, {"row": "r", "leg": "jax-dpa", "time_ms": 3.0},
                    {"row": "r", "leg": "jax", "time_ms": 4.0}], ["n1", "n2"])
    env, roofline, rows, notes = merge_runs([torch_run, jax_run], "python -m parity.bench --quick")
    assert [(r["leg"], r["time_ms"]) for r in rows] == [("sdpa", 1.0), ("torch", 2.0), ("jax-dpa", 3.0),
                                                        ("jax", 4.0)]
    assert env["jax"] == "0.11" and env["torch"] == "2.11" and env["label"] == "l"
    assert env["command"].startswith("python -m parity.bench --quick")
    assert notes == ["n1", "n2"] and roofline == {"gbps": 1.0}
