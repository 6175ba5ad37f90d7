"""Expected end-to-end distortion per preset: what quantization may cost.

The end-to-end check stores raw K/V with a leg, attends with the same leg
(auto path), and compares with float64 attention on the raw K/V
(`parity.checks.dense`). Two numbers per output:

* ``rel_err = ||out - dense||_F / ||dense||_F`` over all rows;
* ``cos = mean over rows with a visible key of cos(out_row, dense_row)``.

The bounds below were derived from a float64 reference run (tq_spec store
then tq_spec attention, i.e. the format's own distortion with no kernel
error) over `calibration_cases()`: every e2e case of the quick and full
catalogs for 16 seeds, data drawn exactly as the catalog draws it (every
preset, head dims 64..512, page sizes, GQA, windows, soft caps, sinks, all
batch mixes and query dtypes). Each bound is the worst value measured there
times `MARGIN` (for ``rel_err`` and for ``1 - cos``), plus one unit roundoff
of the query dtype (2**-8 bf16, 2**-11 fp16, 2**-24 fp32) for the kernel's
own rounding (it computes in fp32 or the query dtype; the reference output
is rounded to the query dtype before measuring, as a leg returns it).
Re-derive with ``python -m parity.checks.distortion`` (prints the measured worst
values) whenever the format, the data generator or the catalog's shapes
change; never to make a kernel pass.

Measured worst values per (preset, data) are in `MEASURED`; the bounds are
`bounds(preset, data, dtype)`. Ordering sanity on normal data (what
TurboQuant predicts): bf16/fp16 << k8v4 < 4bit_nc < k3v4_nc < 3bit_nc.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from .. import tolerances
from ..legs.base import Leg
from ..report.records import FAILED, PASSED, Record
from ..runner.case_run import CaseRun, failed_by, timed

MARGIN = 1.5

# (preset, data) -> (worst rel_err, worst 1 - mean cos) measured by the
# reference run described above: `python -m parity.checks.distortion` over the 2832
# calibration cases (quick + full catalogs, seeds 0..15; 4 min on 2 CPU cores).
# bf16/fp16 rows are the query-dtype rounding of the output (and bf16 rounding
# of fp32/fp16 K/V); quantized rows are the format's distortion. "sharp" data
# (logits of several units, soft-capped cases) amplify key-quantization error,
# and their worst cases are noisier (a few short sequences dominate).
MEASURED: dict[tuple[str, str], tuple[float, float]] = {
    ("bf16", "normal"): (0.002484, 2.93e-06),
    ("bf16", "sharp"): (0.004261, 1.057e-05),
    ("fp16", "normal"): (0.001772, 1.451e-06),
    ("fp16", "sharp"): (0.001665, 2.844e-05),
    ("turboquant_3bit_nc", "normal"): (0.312, 0.04651),
    ("turboquant_3bit_nc", "sharp"): (0.4439, 0.1197),
    ("turboquant_4bit_nc", "normal"): (0.1471, 0.01084),
    ("turboquant_4bit_nc", "sharp"): (0.3101, 0.04617),
    ("turboquant_k3v4_nc", "normal"): (0.2208, 0.02273),
    ("turboquant_k3v4_nc", "sharp"): (0.4799, 0.1328),
    ("turboquant_k8v4", "normal"): (0.1221, 0.007368),
    ("turboquant_k8v4", "sharp"): (0.1485, 0.01134),
}


@dataclass(frozen=True)
class Distortion:
    """End-to-end error of one output against dense float64 attention."""

    rel_err: float
    mean_cos: float
    min_cos: float
    rows: int
    worst: str = ""

    def to_dict(self) -> dict:
        return {"rel_err": self.rel_err, "mean_cos": self.mean_cos, "min_cos": self.min_cos, "rows": self.rows}


def measure(out, dense) -> Distortion:
    """`Distortion` of `out` against `dense` (both ``[T, Hq, D]``)."""
    shape = np.shape(dense)
    o = np.asarray(out, dtype=np.float64).reshape(-1, shape[-1] if len(shape) else 1)
    r = np.asarray(dense, dtype=np.float64).reshape(o.shape)
    if not np.isfinite(o).all():
        t, h = np.unravel_index(int(np.argmax(~np.isfinite(o).all(-1))), shape[:-1])
        return Distortion(float("inf"), float("nan"), float("nan"), int(o.shape[0]),
                          f"non-finite output row [t={t}, h={h}]")
    denom = np.linalg.norm(r)
    rel = float(np.linalg.norm(o - r) / denom) if denom > 0 else float(np.linalg.norm(o))
    rn = np.linalg.norm(r, axis=-1)
    on = np.linalg.norm(o, axis=-1)
    live = rn > 0
    if not live.any():
        return Distortion(rel, 1.0, 1.0, 0)
    cos = (o[live] * r[live]).sum(-1) / np.maximum(rn[live] * on[live], 1e-300)
    row = int(np.flatnonzero(live)[int(np.argmin(cos))])
    t, h = np.unravel_index(row, shape[:-1])
    worst = f"row [t={t}, h={h}]: cos {cos.min():.4f}, |out - dense| {np.linalg.norm(o[row] - r[row]):.3e}, " \
            f"|dense| {rn[row]:.3e}"
    return Distortion(rel, float(cos.mean()), float(cos.min()), int(live.sum()), worst)


UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24}


def bounds(preset: str, data: str, dtype: str) -> tuple[float, float] | None:
    """``(max rel_err, min mean cos)`` for `preset` on `data` with queries of `dtype`.

    None if ``(preset, data)`` was never calibrated.
    """
    m = MEASURED.get((preset, data))
    if m is None:
        return None
    rel, one_minus_cos = m
    u = UNIT_ROUNDOFF[dtype]
    return rel * MARGIN + u, 1.0 - (one_minus_cos * MARGIN + u)


def within(d: Distortion, preset: str, data: str, dtype: str) -> tuple[bool, str]:
    """Whether `d` is within the expected distortion, and a one-line explanation."""
    b = bounds(preset, data, dtype)
    if b is None:
        return False, f"no calibrated distortion for ({preset}, {data}); run python -m parity.checks.distortion"
    max_rel, min_cos = b
    ok = np.isfinite(d.rel_err) and d.rel_err <= max_rel and d.mean_cos >= min_cos
    text = (f"rel_err {d.rel_err:.4g} (max {max_rel:.4g}), mean cos {d.mean_cos:.6f} "
            f"(min {min_cos:.6f}), min row cos {d.min_cos:.4f} over {d.rows} rows")
    return bool(ok), text


def check_e2e(run: CaseRun, leg: Leg) -> list[Record]:
    """Leg store then leg attention (auto) vs dense float64 attention on the raw K/V."""
    def go():
        c = run.case
        try:
            if leg.oracle:
                out = run.ref_out
            else:
                cache = run.problem.hide(run.store(leg))
                out, _ = run.auto_output(leg, cache)
            d = measure(tolerances.to_numpy(out), run.dense)
            ok, text = within(d, c.preset, c.data, c.dtype)
        except Exception as e:
            return failed_by(run, "e2e", leg.name, "auto", e)
        return run.record("e2e", leg.name, "auto", PASSED if ok else FAILED, text, metrics=d.to_dict(),
                          worst="" if ok else d.worst)
    return timed(go)


CALIBRATION_SEEDS = range(16)


def calibration_cases():
    """The cases the bounds are derived from: every e2e case of both catalogs, 4 seeds."""
    from ..catalog.catalog import build_catalog

    seen = {}
    for seed in CALIBRATION_SEEDS:
        for case in build_catalog("quick", seed) + build_catalog("full", seed):
            if "e2e" in case.checks and case.kind == "attention" and not case.far_pages:
                seen.setdefault((seed, case.id), case)
    return seen


def calibrate(stream=sys.stdout) -> dict[tuple[str, str], tuple[float, float]]:
    """Runs the float64 reference end to end on `calibration_cases` and prints the worst values."""
    from tq_spec import reference

    from .dense import dense_attention
    from ..catalog.problem import build_problem, np_dtype

    worst: dict[tuple[str, str], tuple[float, float]] = {}
    items = sorted(calibration_cases().items(), key=lambda kv: kv[0])
    for i, ((seed, _), case) in enumerate(items):
        if i % 50 == 0:
            print(f"calibrating: {i}/{len(items)} cases", file=sys.stderr, flush=True)
        pr = build_problem(case, seed)
        with np.errstate(all="ignore"):
            cache = pr.hide(reference.store_kv(pr.key, pr.value, pr.cache_before, pr.slot_mapping,
                                               **pr.store_kwargs()))
            out = reference.paged_attention(pr.query, cache, *pr.attention_args()[1:], **pr.attention_kwargs())
        out = out.astype(np_dtype(case.dtype)).astype(np.float64)  # as a leg returns it
        dense = dense_attention(pr.seq_queries, pr.seq_keys, pr.seq_values, scale=case.scale,
                                sliding_window=case.sliding_window,
                                logits_soft_cap=case.logits_soft_cap, sinks=pr.sinks)
        d = measure(out, dense)
        key = (case.preset, case.data)
        rel, omc = worst.get(key, (0.0, 0.0))
        worst[key] = (max(rel, d.rel_err), max(omc, 1.0 - d.mean_cos))
    print("MEASURED = {", file=stream)
    for key in sorted(worst):
        rel, omc = worst[key]
        print(f"    {key!r}: ({rel:.4g}, {omc:.4g}),", file=stream)
    print("}", file=stream)
    return worst


if __name__ == "__main__":
    calibrate()
