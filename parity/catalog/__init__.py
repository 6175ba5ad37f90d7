"""The catalog: what to test, as data.

  cases     `AttentionCase` / `ModelCase`: one declarative case (shapes, preset, checks), no arrays.
  sweeps    `Sweep`: cartesian/sampled families of cases; seeded per-case random streams.
  catalog   `build_catalog(mode, seed)` and `select`: the quick and full catalogs, by group.
  problem   `build_problem(case, seed)`: a case turned into arrays (queries, K/V, paged batch,
            block table, poisoned cache) that every leg receives identically.
"""
