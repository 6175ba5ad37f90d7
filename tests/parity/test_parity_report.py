"""The reports survive any result: non-finite metrics, skips with reasons, failures.

A failure with an infinite error is exactly when the report matters most, so the
JSON must stay strict and complete, and the Markdown must still be written.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from parity.report.records import FAILED, PASSED, SKIPPED, UNAVAILABLE, Record
from parity.report.report import console_report, markdown, write_reports
from parity.runner.cli import main

GPU_REASON = "gpu-only case (needs a CUDA device; e.g. a cache over 2 GiB): no GPU here"


def _strict_loads(text: str):
    """json.loads that rejects NaN/Infinity literals, as strict JSON parsers do."""
    def no_constant(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=no_constant)


def _records():
    inf_fail = Record("c-inf", "attention", "torch", "decode", "turboquant_4bit_nc", FAILED,
                      "max error inf > bound 0.01",
                      metrics={"max_err": math.inf, "bound": 0.01, "emulated_err": np.float32(-np.inf),
                               "nonfinite": np.int64(3), "per_row": np.array([1.0, np.nan, np.inf])},
                      worst="[t=2, h=1, d=5] leg=inf ref=0.25 err=inf", legs=("torch",),
                      repro="python -m parity --quick --filter c-inf --seed 0 --legs torch")
    nan_fail = Record("c-nan", "cross", "torch|jax", "auto", "bf16", FAILED, "max error nan",
                      metrics={"max_err": float("nan"), "bound": np.float64(np.nan)}, legs=("torch", "jax"))
    ok = Record("c-ok", "store", "jax", "-", "bf16", PASSED, "bytes equal", metrics={"agree": 1.0})
    gpu = [Record("far", "case", leg, "-", "bf16", SKIPPED, GPU_REASON, legs=(leg,)) for leg in ("torch", "jax")]
    gone = Record("c-ok", "attention", "jax", "auto", "bf16", UNAVAILABLE, "jax not importable")
    return [inf_fail, nan_fail, ok, *gpu, gone]


def test_reports_survive_inf_and_nan(tmp_path):
    meta = {"mode": "quick", "seed": 0, "seconds": math.inf, "legs_text": ["torch: test"]}
    json_path, md_path = write_reports(str(tmp_path), _records(), meta=meta, cases=[])
    doc = _strict_loads(open(json_path).read())
    recs = {(r["case_id"], r["op"]): r for r in doc["records"]}
    m = recs[("c-inf", "attention")]["metrics"]
    # Non-finite numbers become the strings "inf", "-inf", "nan" (documented in parity.report.report).
    assert m["max_err"] == "inf" and m["emulated_err"] == "-inf" and m["bound"] == 0.01
    assert m["nonfinite"] == 3 and m["per_row"] == [1.0, "nan", "inf"]
    assert recs[("c-nan", "cross")]["metrics"] == {"max_err": "nan", "bound": "nan"}
    assert doc["meta"]["seconds"] == "inf"
    assert doc["summary"] == {"passed": 1, "failed": 2, "skipped": 3}
    assert sorted(os.listdir(tmp_path)) == ["parity.json", "parity.md"]  # no temporary files left

    md = open(md_path).read()
    assert "## Failures" in md and "worst: [t=2, h=1, d=5] leg=inf" in md
    assert "repro: `python -m parity --quick --filter c-inf --seed 0 --legs torch`" in md
    assert "## Checks" in md
    for op in ("attention", "cross", "store", "case"):  # every check name present is explained
        assert f"- **{op}**: " in md and "(no description)" not in md
    assert "## Skipped" in md and f"{GPU_REASON} (2 record(s), 1 case(s))" in md
    assert "jax: jax not importable" in md


def test_a_failed_write_keeps_the_previous_report(tmp_path, monkeypatch):
    import parity.report.report as report

    write_reports(str(tmp_path), _records(), meta={"mode": "quick"}, cases=[])
    before = (tmp_path / "parity.json").read_text()

    def boom(records, meta):
        raise RuntimeError("markdown failed")

    monkeypatch.setattr(report, "markdown", boom)
    with pytest.raises(RuntimeError):
        write_reports(str(tmp_path), _records()[:1], meta={"mode": "full"}, cases=[])
    # The JSON was replaced whole (never truncated); the Markdown kept its old complete text.
    _strict_loads((tmp_path / "parity.json").read_text())
    assert (tmp_path / "parity.md").read_text().startswith("# Parity report")
    assert sorted(os.listdir(tmp_path)) == ["parity.json", "parity.md"]
    assert before != (tmp_path / "parity.json").read_text()


def test_console_lists_skip_reasons_with_counts():
    out = console_report(_records(), ["torch: test"])
    assert f"skipped: {GPU_REASON} (2 record(s), 1 case(s))" in out
    assert "unavailable: jax: jax not importable (1 records skipped)" in out
    assert out.strip().splitlines()[-1] == "parity: 1 passed, 2 failed, 3 skipped"


def test_markdown_without_records():
    md = markdown([], {"mode": "quick"})
    assert md.startswith("# Parity report") and "parity: 0 passed, 0 failed, 0 skipped" in md


def test_cli_prints_why_gpu_only_cases_were_skipped(tmp_path, capsys):
    rc = main(["--quick", "--filter", "far-pages:bf16", "--legs", "numpy", "--no-progress",
               "--report", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"skipped: {GPU_REASON} (" in out
    assert GPU_REASON in (tmp_path / "parity.md").read_text()


def test_cli_report_survives_a_real_infinite_error(tmp_path, capsys):
    """End to end: a leg whose output holds +inf fails with max_err inf; both reports are written."""
    one = "flashinfer-short:4bit-d64-h14x2-p16-s9q8-bf16"
    rc = main(["--quick", "--filter", one, "--legs", "broken-inf-output", "--no-progress", "--report", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1, out
    doc = _strict_loads((tmp_path / "parity.json").read_text())
    failed = [r for r in doc["records"] if r["status"] == "failed" and r["op"] == "attention"]
    assert failed and all(r["metrics"]["max_err"] == "inf" for r in failed)
    md = (tmp_path / "parity.md").read_text()
    assert "## Failures" in md and "worst: [t=0, h=0, d=0]: got inf" in md
    assert f"repro: `python -m parity --quick --filter {one} --seed 0 --legs broken-inf-output`" in md
    assert "- **attention**: " in md
