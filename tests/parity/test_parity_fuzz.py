"""The fuzzer (`python -m parity --fuzz N --seed S`): valid random cases, specs that round-trip, shrinking
to a one-line repro, and a small run through the real kernels (what CI runs)."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from parity.catalog.cases import AttentionCase
from parity.catalog.fuzz import FUZZ_CHECKS, case_spec, draw_case, fuzz_cases, parse_case_spec, shrink
from parity.catalog.problem import build_problem
from parity.runner.cli import main


def test_draws_are_valid_reproducible_and_varied():
    cases = fuzz_cases(60, seed=5)
    assert [c.id for c in cases] == [c.id for c in fuzz_cases(60, seed=5)]
    assert {c.id for c in cases} != {c.id for c in fuzz_cases(60, seed=6)}
    seen = lambda f: {f(c) for c in cases}  # noqa: E731
    assert len(seen(lambda c: c.preset)) == 6 and len(seen(lambda c: c.block_size)) >= 5
    assert {True, False} <= seen(lambda c: c.sinks) and None in seen(lambda c: c.sliding_window)
    assert len(seen(lambda c: c.num_q_heads // c.num_kv_heads)) >= 5
    assert any(c.shared_pages for c in cases) and any(c.pad_rows for c in cases)
    assert any(q == 0 for c in cases for _, q in c.seqs) and any(len(c.seqs) > 2 for c in cases)
    for c in cases[:20]:
        pr = build_problem(c, 0)  # builds (valid metadata, reference-checked by the runner)
        from tq_spec import reference

        reference.paged_attention(pr.query, pr.hide(reference.store_kv(pr.key, pr.value, pr.cache_before,
                                                                      pr.slot_mapping, **pr.store_kwargs())),
                                  *pr.attention_args()[1:], **pr.attention_kwargs())


def test_shared_pages_repeat_the_first_sequence_pages():
    c = AttentionCase("fuzz", "bf16", 64, 2, 1, 4, ((13, 2), (11, 1), (6, 6)), shared_pages=2)
    pr = build_problem(c, 0)
    bt = pr.block_table
    assert (bt[1, :2] == bt[0, :2]).all() and (bt[2, :1] == bt[0, :1]).all()
    assert len(set(pr.slot_mapping[pr.slot_mapping >= 0].tolist())) == (pr.slot_mapping >= 0).sum()
    import numpy as np

    np.testing.assert_array_equal(pr.seq_keys[1][:8], pr.seq_keys[0][:8])


def test_case_spec_round_trips():
    for i in range(30):
        c = draw_case(3, i)
        back = parse_case_spec(case_spec(c))
        assert back.id == c.id and dataclasses.replace(back, tags=c.tags) == c
    with pytest.raises(ValueError, match="unknown fields"):
        parse_case_spec('{"preset": "bf16", "colour": 1}')
    with pytest.raises(ValueError, match="JSON"):
        parse_case_spec("not json")


def test_shrink_finds_the_smallest_failing_case():
    c = AttentionCase("fuzz", "turboquant_4bit_nc", 128, 12, 3, 5, ((30, 4), (17, 1), (9, 9)),
                      sliding_window=7, logits_soft_cap=5.0, sinks=True, data="sharp", pad_rows=3, shared_pages=1,
                      checks=FUZZ_CHECKS)

    def fails(x):  # a pretend bug: any window on a sequence longer than 8
        return x.sliding_window is not None and any(s > 8 for s, _ in x.seqs)

    small, runs = shrink(c, fails, budget=200)
    assert fails(small) and runs <= 200
    assert len(small.seqs) == 1 and small.sinks is False and small.logits_soft_cap is None
    assert small.pad_rows == 0 and small.num_q_heads == small.num_kv_heads == 1 and small.head_dim == 64
    assert small.seqs[0][0] in (9, 10, 11, 12, 13, 14, 15, 16)


def test_fuzz_with_a_broken_leg_prints_a_shrunk_repro(capsys):
    rc = main(["--fuzz", "12", "--seed", "1", "--legs", "broken-window-off-by-one", "--no-progress",
               "--shrink-budget", "25"])
    out = capsys.readouterr().out
    assert rc == 1, out
    lines = [line for line in out.splitlines() if line.startswith("  repro: python -m parity --case ")]
    assert lines and "shrunk (" in out
    # The printed repro runs as written and still fails.
    argv = shlex.split(lines[0].removeprefix("  repro: "))[3:]
    assert main(argv + ["--no-progress"]) == 1
    capsys.readouterr()


def test_case_option_and_list(capsys):
    spec = case_spec(AttentionCase("case", "bf16", 64, 4, 2, 16, ((9, 1), (5, 5))))
    assert main(["--case", spec, "--list"]) == 0
    assert "case:bf16-d64-h4x2-p16-s9q1+s5q5-bf16" in capsys.readouterr().out
    assert main(["--case", spec, "--legs", "numpy", "--no-progress"]) == 0
    assert main(["--case", "{]", "--list"]) == 2
    assert main(["--fuzz", "0", "--list"]) == 2
    capsys.readouterr()


def test_fuzz_smoke_through_the_kernels(capsys):
    """What CI runs: a few fuzz cases through the reference, torch and jax legs (interpreters on CPU)."""
    rc = main(["--fuzz", "2", "--seed", "0", "--no-progress", "--jobs", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.strip().splitlines()[-1].startswith("parity: ") and " 0 failed" in out.strip().splitlines()[-1]
