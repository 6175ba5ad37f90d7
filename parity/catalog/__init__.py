"""The catalog: what to test, as data.

  cases     `AttentionCase` / `ModelCase` / `ErrorCase`: one declarative case (shapes, preset,
            checks), no arrays.
  sweeps    `Sweep`: cartesian/sampled families of cases; seeded per-case random streams.
  catalog   `build_catalog(mode, seed)` and `select`: the quick and full catalogs, by group.
  problem   `build_problem(case, seed)`: a case turned into arrays (queries, K/V, paged batch,
            block table, poisoned cache) that every leg receives identically.
  bad_inputs  the bad-input table (argument errors, bad metadata values, foreign arrays, valid edge
            cases) behind the ``errors`` check and tests/test_bad_inputs.py.
  fuzz      `fuzz_cases(n, seed)`: random valid cases for ``--fuzz``; `case_spec` / `parse_case_spec`
            (``--case``) and `shrink`.
"""
