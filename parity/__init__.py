"""parity: the cross-framework parity suite.

Runs a declarative catalog of cases (`parity.catalog`) through every
available leg (`parity.legs`: the tq_spec float64 reference, tq_torch on
Triton, tq_jax on Pallas) and compares them (`parity.checks`, tolerances in
`parity.tolerances`). Command line: ``python -m parity`` (see `parity.cli`).

Importing this package imports no framework: the CLI first sets the
environment (`parity.environment`), then loads legs.
"""
