"""`python -m parity.bench --smoke`: every op, leg, baseline and report path runs on CPU and every
timed configuration passed the float64 reference gate. No time is asserted (DESIGN.md section 7)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from parity.bench.cli import main
from parity.bench.shapes import OPS, quick_rows, smoke_rows


def test_smoke_runs_checks_and_reports(tmp_path, capsys):
    # Plots need the optional `bench` extra (CI installs it); without matplotlib
    # everything else must still run and the page must say why there are no plots.
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    rc = main(["--smoke", "--out", str(tmp_path / "run"), "--benchmarks-md", str(tmp_path / "BENCHMARKS.md"),
               "--label", "smoke-test", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    assert "Goal rows (measured vs target)" in captured.out
    assert "| goal | preset | leg |" in captured.out

    doc = json.loads((tmp_path / "run" / "bench.json").read_text())
    rows = doc["rows"]
    kernel = [r for r in rows if r["leg"] in ("torch", "jax")]
    assert kernel and all(r["status"] == "ok" for r in kernel), [
        (r["row"], r["preset"], r["leg"], r["status"], r["check"]) for r in kernel if r["status"] != "ok"]
    assert all(r["check"].startswith(("attention ok", "store[")) for r in kernel)
    assert {r["op"] for r in kernel} == set(OPS)
    for op in OPS:
        for leg in ("torch", "jax"):
            assert len({r["preset"] for r in kernel if r["op"] == op and r["leg"] == leg}) >= 2, (op, leg)
    baselines = {r["leg"] for r in rows if r["leg"] not in ("torch", "jax")}
    assert baselines == {"sdpa", "jax-dpa"}
    assert doc["roofline"]["gbps"] > 0
    assert doc["environment"]["label"] == "smoke-test" and "--smoke" in doc["environment"]["command"]
    assert doc["goals"], "the goal table is empty"

    md = (tmp_path / "run" / "bench.md").read_text()
    assert "## Goals" in md and "## decode" in md and "## store" in md
    if has_matplotlib:
        assert (tmp_path / "run" / "roofline.png").stat().st_size > 0
    else:
        assert "matplotlib" in md and not (tmp_path / "run" / "roofline.png").exists()
    page = (tmp_path / "BENCHMARKS.md").read_text()
    assert "## Reproduce" in page and (("run/roofline.png" in page) == has_matplotlib)

    # The reports of a finished run can be rebuilt without running anything.
    assert main(["--from-json", str(tmp_path / "run"), "--out", str(tmp_path / "again")]) == 0
    assert json.loads((tmp_path / "again" / "bench.json").read_text())["rows"] == rows
    # ... and compared with another run: every checked kernel row appears with both times.
    assert main(["--from-json", str(tmp_path / "run"), "--compare-json", str(tmp_path / "again"),
                 "--out", str(tmp_path / "compared")]) == 0
    compared = (tmp_path / "compared" / "bench.md").read_text()
    table = compared.split("## Before / after", 1)[1].split("\n## ", 1)[0]
    assert "smoke-test" in table
    assert sum(line.endswith("| 1.00x |  |") for line in table.splitlines()) == len(kernel)


def test_tables_are_declarative():
    quick = quick_rows()
    assert len({r.id for r in quick}) == len(quick)
    roles = {r.role for r in quick if r.role}
    from parity.bench.goals import GOALS

    assert {g.role for g in GOALS} <= roles, "a goal names a role no --quick row has"
    assert {g.role for g in GOALS} <= {r.role for r in smoke_rows()} | {"decode-d256", "decode-gqa1", "decode-gqa8"}
    assert all(r.op in OPS for r in quick + smoke_rows())


def test_list_and_bad_arguments(capsys):
    assert main(["--list", "--ops", "store"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "1 row(s)" and out[0].startswith("store-")
    assert main(["--smoke", "--legs", "cuda"]) == 2
    assert "unknown leg" in capsys.readouterr().err


def test_a_wrong_kernel_is_reported_and_not_timed(tmp_path, monkeypatch, capsys):
    import dataclasses

    from parity.bench import legs

    real = legs.TorchBench.attention

    def off_by_a_quarter(self, inp, cache, preset):
        p = real(self, inp, cache, preset)
        return dataclasses.replace(p, first=lambda: p.first() * 1.25)

    monkeypatch.setattr(legs.TorchBench, "attention", off_by_a_quarter)
    rc = main(["--smoke", "--filter", "decode-smoke-b1", "--legs", "torch", "--out", str(tmp_path), "--no-progress"])
    assert rc == 1
    assert "WRONG: decode-smoke-b1-40-p16" in capsys.readouterr().err
    (r,) = [r for r in json.loads((tmp_path / "bench.json").read_text())["rows"] if r["leg"] == "torch"]
    assert r["status"] == "WRONG" and "time_ms" not in r and "attention FAIL" in r["check"]


def test_goal_evaluation_on_synthetic_records():
    from parity.bench.goals import evaluate

    def rec(row, role, leg, time_ms, speedup, **kw):
        return {"row": row, "role": role, "preset": "turboquant_4bit_nc", "leg": leg, "status": "ok",
                "time_ms": time_ms, "loop_ms": time_ms, "speedup_sdpa": speedup, **kw}

    rows = [rec("base", "decode-base", "torch", 1.0, 3.0), rec("base", "decode-base", "jax", 1.2, 2.5),
            rec("d256", "decode-d256", "torch", 2.0, 2.1), rec("q4", "decode-q4", "torch", 1.4, 2.0),
            rec("pre", "prefill", "torch", 4.0, 0.5), {**rec("st", "store", "torch", 1.0, None),
                                                        "store_input_gbps": 1600.0}]
    got = {(g.goal.metric, g.leg, g.row): g for g in evaluate(rows)}
    assert got[("speedup", "torch", "base")].met is True and got[("speedup", "jax", "base")].met is True
    assert abs(got[("speedup_vs_base", "torch", "d256")].measured - 0.7) < 1e-12
    assert got[("speedup_vs_base", "torch", "d256")].met is False
    assert abs(got[("time_vs_base", "torch", "q4")].measured - 1.4) < 1e-12
    assert got[("time_vs_sdpa", "torch", "pre")].measured == 2.0 and got[("time_vs_sdpa", "torch", "pre")].met is False
    assert got[("store_gbps", "torch", "st")].met is True
    assert abs(got[("jax_vs_torch", "jax", "base")].measured - 1.2) < 1e-12
