"""The checks: one module per kind of comparison (DESIGN.md section 5).

Each ``check_*`` function runs one comparison on a `parity.runner.case_run.CaseRun`
and returns `parity.report.records.Record`s. All comparisons of the suite:

  store        leg store_kv bytes vs the reference (`parity.tolerances.compare_store`).
               -> `parity.checks.store`
  attention    leg paged_attention on the reference's cache bytes vs the float64
               reference on the same bytes, per forced path. -> `parity.checks.attention`
  paths        every path of a leg agrees with every other within their bounds.
               -> `parity.checks.paths`
  e2e          leg store then leg attention vs dense float64 attention on raw K/V
               (`parity.checks.dense`), within the preset's expected distortion.
               -> `parity.checks.distortion`
  cross        torch vs jax attention outputs directly (sum of their bounds).
  cross-store  torch vs jax cache bytes: codes may differ only where each is
               within tolerance of the reference; fp fields equal (1 ulp on the
               fp16 key norm, whose fp32 sum order is implementation-defined, and
               on fp8 under the Triton interpreter).
  interchange  cache written by one leg, read by another, vs the reference on those bytes.
               -> `parity.checks.pairs` (cross, cross-store, interchange)
  chunking     the same tokens stored and attended in chunks == one prefill.
               -> `parity.checks.chunking`
  model        several layers in model order, each vs the reference for its own metadata.
               -> `parity.checks.model`
  determinism  the same inputs twice through one leg: identical store bytes and outputs.
               -> `parity.checks.determinism`
  cuda-graph   the torch decode path captured in a CUDA graph and replayed with changing
               seq_lens equals eager (GPU only). -> `parity.checks.cuda_graph`
  errors       a bad-input row (`parity.catalog.bad_inputs`) through every kernel leg, with
               and without validation, in a sandbox child with guard canaries.
               -> `parity.checks.errors`

Where the reference has NaN or Inf (a visible NaN/Inf input propagating), a leg must have the
same NaN or Inf there (`parity.tolerances.check_attention`; `paths.max_diff` counts the same
non-finite value on both sides as agreement).
"""
