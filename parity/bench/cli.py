"""``python -m parity.bench``: command line, run, report.

On a GPU: ``python -m parity.bench --quick`` (the goal rows, under 8 minutes)
or ``--full``; with both legs, each leg runs in its own process (`isolate`).
On a CPU: ``--smoke`` (tiny shapes in the interpreters; checks that every op,
leg, baseline and report path runs and is correct; its times mean nothing).
``--out DIR`` writes bench.json, bench.md and the plots;
``--benchmarks-md FILE`` also writes the curated page (BENCHMARKS.md);
``--from-json DIR`` redoes the reports of an earlier run without running.
"""

from __future__ import annotations

import argparse
import os
import sys

import tq_spec

from ..runner import environment
from .shapes import DEFAULT_BUDGET_GIB, OPS, full_rows, quick_rows, select, smoke_rows


BENCH_LEGS = ("torch", "jax")


def _csv(text: str | None) -> tuple[str, ...] | None:
    if not text:
        return None
    return tuple(x.strip() for x in text.split(",") if x.strip())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m parity.bench", description=(
        "Time tq_torch and tq_jax (every op, every preset) against SDPA bf16 and a copy roofline, after "
        "checking each configuration against the float64 reference."))
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="only the rows that decide the goals (default)")
    mode.add_argument("--full", action="store_true", help="the whole shape table (the quick rows and the rest)")
    mode.add_argument("--smoke", action="store_true", help="tiny shapes in the CPU interpreters: checks that "
                      "everything runs and is correct; timings are printed, not meaningful")
    p.add_argument("--filter", action="append", default=[], metavar="SUBSTR",
                   help="keep rows whose id contains SUBSTR or whose goal role is SUBSTR (repeatable, comma-separated)")
    p.add_argument("--ops", help=f"comma-separated ops to run, of {', '.join(OPS)}")
    p.add_argument("--legs", default="torch,jax", help="comma-separated legs (torch, jax); default both")
    p.add_argument("--presets", help="comma-separated presets (default: each row's presets)")
    p.add_argument("--out", metavar="DIR", help="write DIR/bench.json, DIR/bench.md and DIR/*.png")
    p.add_argument("--benchmarks-md", metavar="FILE", help="also write the curated page FILE (e.g. BENCHMARKS.md) "
                   "linking the plots in --out")
    p.add_argument("--from-json", metavar="DIR", help="do not run: rebuild the reports from DIR/bench.json")
    p.add_argument("--compare-json", metavar="DIR", help="add a before/after table against the run in "
                   "DIR/bench.json (e.g. the baseline kernels) to the reports")
    p.add_argument("--label", default="", help="free text stored with the results (e.g. 'baseline')")
    p.add_argument("--seed", type=int, default=0, help="seed of every input (default 0)")
    p.add_argument("--budget-gib", type=float, default=DEFAULT_BUDGET_GIB,
                   help=f"skip rows needing more device memory than this (default {DEFAULT_BUDGET_GIB:g})")
    p.add_argument("--list", action="store_true", help="list the selected rows and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress output on stderr")
    return p


def _rows(args):
    if args.smoke:
        rows = smoke_rows()
    elif args.full:
        rows = quick_rows() + full_rows()
    else:
        rows = quick_rows()
    filters = tuple(f for spec in args.filter for f in _csv(spec) or ())
    ops = _csv(args.ops)
    if ops:
        bad = [o for o in ops if o not in OPS]
        if bad:
            raise SystemExit(f"--ops: unknown {', '.join(bad)}; expected some of {', '.join(OPS)}")
    return select(rows, filters=filters, ops=ops)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    if args.from_json:
        return _report_only(args)
    rows = _rows(args)
    presets = _csv(args.presets)
    leg_names = _csv(args.legs) or ()
    bad = [n for n in leg_names if n not in BENCH_LEGS] + [p for p in presets or () if p not in tq_spec.PRESET_NAMES]
    if bad:
        print(f"unknown leg or preset: {', '.join(bad)}; legs: {', '.join(BENCH_LEGS)}; presets: "
              f"{', '.join(tq_spec.PRESET_NAMES)}", file=sys.stderr)
        return 2
    if args.list:
        for r in rows:
            print(f"{r.id}  presets={','.join(r.preset_list(presets))}" + (f"  role={r.role}" if r.role else ""))
        print(f"{len(rows)} row(s)")
        return 0
    if not rows:
        print("no rows selected", file=sys.stderr)
        return 2

    # Before anything imports triton or jax; timings exclude validate='s host sync.
    on_gpu = environment.configure(validate=False)
    if on_gpu and len(leg_names) > 1 and not args.smoke:
        return _legs_apart(args, argv, leg_names)
    if not on_gpu and not args.smoke:
        print("note: no GPU; the kernels run in interpreters (use --smoke for tiny shapes)", file=sys.stderr)
    from .goals import evaluate
    from .legs import load_bench_legs
    from .progress import BenchProgress
    from .run import BenchRun, RunOptions, steps_of

    legs, missing = load_bench_legs(leg_names, on_gpu, args.smoke)
    for m in missing:
        print(f"leg unavailable: {m}", file=sys.stderr)
    if not legs:
        print("no leg can run here", file=sys.stderr)
        return 2
    progress = BenchProgress(steps_of(rows, presets, len(legs)), enabled=not args.no_progress)
    opts = RunOptions(seed=args.seed, presets=presets, budget_bytes=int(args.budget_gib * 2**30),
                      on_gpu=on_gpu, smoke=args.smoke)
    result = BenchRun(legs, opts, "cuda" if on_gpu else "cpu", progress).run(rows)
    progress.close()

    from .results import environment as run_env

    env = run_env(on_gpu, argv, args.label)
    notes = [f"leg unavailable: {m}" for m in missing]
    if args.smoke:
        notes.append("--smoke: tiny shapes in the CPU interpreters; times are not meaningful")
    goals = evaluate(result.rows)
    _write(args, env, result.roofline, result.rows, goals, notes)
    # The exit status reflects the kernels (a baseline that cannot run is reported, not fatal).
    bad = [r for r in result.rows if r["status"] in ("WRONG", "error") and r["leg"] in BENCH_LEGS]
    print(f"{len(result.rows)} records, {len(bad)} kernel configurations WRONG or in error", file=sys.stderr)
    return 1 if bad else 0


def _legs_apart(args, argv, leg_names) -> int:
    """GPU runs of several legs: one child process per leg (`isolate`), reports of the merged rows."""
    import shlex
    import tempfile

    from .goals import evaluate
    from .isolate import merge_runs, run_legs_apart

    with tempfile.TemporaryDirectory() as tmp:
        status, docs = run_legs_apart(argv, leg_names, tmp)
    if not docs:
        return status or 2
    command = "python -m parity.bench " + " ".join(shlex.quote(a) for a in argv)
    env, roofline, rows, notes = merge_runs(docs, command)
    _write(args, env, roofline, rows, evaluate(rows), notes)
    bad = [r for r in rows if r["status"] in ("WRONG", "error") and r["leg"] in BENCH_LEGS]
    print(f"{len(rows)} records (legs in separate processes), {len(bad)} kernel configurations WRONG or in error",
          file=sys.stderr)
    return 1 if bad else status


def _write(args, env, roofline, rows, goals, notes) -> None:
    """Prints the goal table; writes JSON, Markdown, plots and the curated page where asked."""
    from .plots import write_plots
    from .results import goal_table, load, markdown, write_json

    smoke = any("--smoke" in n for n in notes)
    print("\nGoal rows (measured vs target)" + (" -- --smoke: CPU interpreters, numbers not meaningful" if smoke
                                                 else "") + ":\n")
    print(goal_table(goals))
    if not args.out:
        return
    os.makedirs(args.out, exist_ok=True)
    plots, why = write_plots(rows, args.out)
    if why:
        notes = notes + [why]
    before = load(os.path.join(args.compare_json, "bench.json")) if args.compare_json else None
    write_json(os.path.join(args.out, "bench.json"), env, roofline, rows, goals, notes)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(markdown(env, roofline, rows, goals, notes, plots, before=before))
    print(f"\nwrote {args.out}/bench.json, {args.out}/bench.md" + "".join(f", {args.out}/{p}" for p in plots))
    if args.benchmarks_md:
        page_dir = os.path.dirname(os.path.abspath(args.benchmarks_md))
        rel = [os.path.relpath(os.path.join(os.path.abspath(args.out), p), page_dir) for p in plots]
        # Curated same-run A/B tables of the decisive kernel steps, kept by hand next to the run.
        steps_path = os.path.join(args.out, "steps.md")
        steps = open(steps_path).read().rstrip() + "\n" if os.path.exists(steps_path) else ""
        with open(args.benchmarks_md, "w") as f:
            f.write(markdown(env, roofline, rows, goals, notes, rel, title="Benchmarks", before=before)
                    + ("\n" + steps if steps else "") + _REGENERATE)
        print(f"wrote {args.benchmarks_md}")


_REGENERATE = """
## Reproduce

On one H100/H200 (`XLA_PYTHON_CLIENT_PREALLOCATE=false` lets JAX and torch share it):

```bash
XLA_PYTHON_CLIENT_PREALLOCATE=false python -m parity.bench --quick --out docs/bench --benchmarks-md BENCHMARKS.md
```

or, from the results directory of an earlier run (`--out DIR`):

```bash
python -m parity.bench --from-json DIR --out docs/bench --benchmarks-md BENCHMARKS.md
```

The before/after table compares with the kernels of an earlier commit (here the
baseline 7564f73), benchmarked by the same suite from a folder that holds their packages
(its own folder comes first on `sys.path`, so those packages shadow the checkout's):

```bash
mkdir .baseline && git archive 7564f73 tq_torch tq_jax tq_spec | tar -x -C .baseline
(cd .baseline && PYTHONPATH=.:.. XLA_PYTHON_CLIENT_PREALLOCATE=false python -m parity.bench --quick \\
    --out ../docs/bench/baseline --label "baseline: tq_torch/tq_jax/tq_spec of 7564f73")
python -m parity.bench --from-json docs/bench --compare-json docs/bench/baseline --out docs/bench \\
    --benchmarks-md BENCHMARKS.md
```
"""


def _report_only(args) -> int:
    """--from-json: reports (goal table, Markdown, plots, curated page) of a finished run."""
    from .goals import evaluate
    from .results import load

    src = os.path.join(args.from_json, "bench.json")
    doc = load(src)
    rows = doc["rows"]
    notes = [n for n in doc.get("notes", []) if not n.startswith("matplotlib")]
    _write(args, doc["environment"], doc["roofline"], rows, evaluate(rows), notes)
    return 0
