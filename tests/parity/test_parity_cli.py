"""`python -m parity`: listing, filtering, exit codes, the final line, reports, repro lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from parity.runner.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ONE = "flashinfer-short:4bit-d64-h14x2-p16-s9q8-bf16"


def test_list_and_filter(capsys):
    assert main(["--quick", "--list", "--filter", "gqa"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].endswith("case(s) in the quick catalog (seed 0)")
    assert len(out) > 2 and all(line.startswith("gqa:") for line in out[:-1])


def test_no_match_is_an_error(capsys):
    assert main(["--quick", "--filter", "no-such-case"]) == 2
    assert "no case" in capsys.readouterr().err


def test_unknown_leg_is_an_error(capsys):
    assert main(["--quick", "--legs", "reference,cuda", "--list"]) == 2
    assert "--legs" in capsys.readouterr().err


def test_pass_final_line_and_reports(tmp_path, capsys):
    rc = main(["--quick", "--filter", ONE, "--legs", "numpy", "--report", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("parity: ") and last.endswith(" failed, 0 skipped") and ", 0 failed," in last
    assert "op " in out and "preset" in out and "path" in out  # the summary table
    doc = json.loads((tmp_path / "parity.json").read_text())
    assert doc["meta"]["mode"] == "quick" and doc["summary"]["failed"] == 0
    keys = {(r["case_id"], r["op"], r["leg"], r["path"], r["layer"]) for r in doc["records"]}
    assert len(keys) == len(doc["records"])  # one record per case x op x leg x path
    assert ONE in doc["cases"]
    md = (tmp_path / "parity.md").read_text()
    assert "| op | preset | path |" in md and last in md


def test_broken_leg_fails_with_repro(capsys):
    rc = main(["--quick", "--filter", "gqa:4bit", "--legs", "broken-gqa-modulo", "--seed", "3", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL gqa:4bit-d64-h14x2-p16-s10q1+s7q3-bf16 [attention broken-gqa-modulo" in out
    assert "  worst: [t=" in out
    assert ("  repro: python -m parity --quick --filter gqa:4bit-d64-h14x2-p16-s10q1+s7q3-bf16 --seed 3 "
            "--legs broken-gqa-modulo") in out
    assert out.strip().splitlines()[-1].startswith("parity: ") and " 0 failed" not in out.strip().splitlines()[-1]


def test_unavailable_leg_counts_as_skipped(monkeypatch, capsys):
    import parity.legs as legs
    from parity.legs.base import Unavailable

    real = legs.load_leg
    monkeypatch.setattr(legs, "load_leg", lambda n: Unavailable(n, "not built here") if n == "jax" else real(n))
    rc = main(["--quick", "--filter", ONE, "--legs", "numpy,jax", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "unavailable: jax: not built here" in out
    last = out.strip().splitlines()[-1]
    assert ", 0 failed, " in last and not last.endswith(" 0 skipped")


def test_module_entry_point_runs():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "parity", "--quick", "--list", "--filter", ONE],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[0].startswith(ONE)


def test_help_lists_options(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for opt in ("--quick", "--full", "--legs", "--filter", "--list", "--seed", "--report", "--fail-fast"):
        assert opt in text


def test_errors_op_through_the_cli(tmp_path, capsys, monkeypatch):
    """The errors op in `python -m parity`: rows as cases, records per leg and mode, known failures xfailed."""
    from parity.catalog import bad_inputs as catalog

    assert main(["--quick", "--list", "--filter", "errors"]) == 0
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("errors:")]
    assert len(listed) == len(catalog.bad_inputs())
    # A row that passes, listed as a known jax failure: the report must call it xpassed, a failure.
    monkeypatch.setitem(catalog.KNOWN, "attention/all-padding", (("jax", "*", "listed as known by this test"),))
    known = catalog.row_by_id("attention/all-padding")
    assert known.known
    rc = main(["--quick", "--filter", f"errors:store/slot-eq-NP,errors:{known.id}", "--jobs", "1", "--no-progress",
               "--report", str(tmp_path)])
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "parity.json").read_text())
    recs = [r for r in doc["records"] if r["op"] == "errors"]
    assert {r["leg"] for r in recs} == {"torch", "jax", "torch|jax"}
    assert {r["path"] for r in recs if r["case_id"] == "errors:store/slot-eq-NP"} == {
        "validated:auto", "unvalidated:auto"}
    store = [r for r in recs if r["case_id"] == "errors:store/slot-eq-NP"]
    assert all(r["status"] == "passed" for r in store), [r["detail"] for r in store]
    # A known failure that passes is reported as xpassed, with status failed, and fails the run.
    mine = [r for r in recs if r["case_id"] == f"errors:{known.id}" and r["leg"] == "jax"]
    assert mine and all(r["status"] == "failed" and r["detail"].startswith("xpassed") for r in mine), mine
    assert rc == 1, out
    md = (tmp_path / "parity.md").read_text()
    assert "- **errors**: " in md
