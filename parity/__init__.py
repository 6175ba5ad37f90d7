"""parity: the cross-framework parity suite.

Runs a declarative catalog of cases through every available leg (the tq_spec
float64 reference, tq_torch on Triton, tq_jax on Pallas) and compares them.
Command line: ``python -m parity`` (see `parity.runner.cli`). Layout:

  parity.catalog     what to test, as data: cases, sweeps, the quick/full catalogs,
                     `problem` (a case turned into arrays), `bad_inputs` (the errors
                     op's table) and `fuzz` (random valid cases and their shrinking).
  parity.checks      one module per kind of comparison (store, attention, paths,
                     pairs, chunking, model, distortion, determinism, cuda_graph,
                     errors); see its docstring.
  parity.tolerances  every bound and comparison rule, in one place (DESIGN.md section 5).
  parity.legs        the implementations under test behind one interface.
  parity.runner      the runner, worker processes, the sandbox child for risky calls,
                     progress line, CLI and environment set-up.
  parity.report      result records, console summary, JSON and Markdown reports.

Importing this package imports no framework: the CLI first sets the
environment (`parity.runner.environment`), then loads legs.
"""
