"""parity.bench: the benchmark suite (``python -m parity.bench``), the yardstick of every speed claim.

  shapes     the declarative shape table: `BenchRow`s of --quick (the goal rows), --full, --smoke.
  inputs     fresh random device inputs of a row (permuted block tables, poisoned caches).
  legs       tq_torch and tq_jax behind one interface, public ops only.
  baselines  torch SDPA and jax dot_product_attention on contiguous bf16 K/V; the copy roofline.
  gate       the correctness gate: sampled float64 reference checks before anything is timed.
  timing     what each measure means and how it is taken (do_bench, CUDA graphs, loops, AOT compiles).
  run        the loop: rows x presets x legs -> flat result records.
  goals      the speed goals as data, and their evaluation.
  results    bench.json and the Markdown tables (bench.md, BENCHMARKS.md).
  plots      PNG plots (optional matplotlib: the `bench` extra).
  progress   the progress bar with an ETA.
  cli        the command line.

Nothing here is imported by ``python -m parity``; nothing in a unit test asserts a time.
"""
