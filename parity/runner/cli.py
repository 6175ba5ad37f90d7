"""``python -m parity``: run the parity catalog through every available leg."""

from __future__ import annotations

import argparse
import datetime
import signal
import sys
import time

from . import environment


def _split(values) -> list[str]:
    out = []
    for v in values or ():
        out += [p.strip() for p in v.split(",") if p.strip()]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m parity",
        description="Cross-check the tq_torch (Triton) and tq_jax (Pallas) kernels against each other and "
                    "against the tq_spec float64 reference on a catalog of cases.",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="small shapes (default without a GPU; kernels run in interpreters)")
    size.add_argument("--full", action="store_true", help="the whole catalog at realistic sizes (default on a GPU)")
    p.add_argument("--legs", default="reference,torch,jax",
                   help="comma-separated legs to run (reference, torch, jax); default: all three. "
                        "Self-test legs: numpy (the reference behind the kernel interface) and "
                        "broken-<kind> (deliberately wrong; must fail)")
    p.add_argument("--filter", action="append", metavar="PATTERN",
                   help="keep cases whose id contains PATTERN or that carry tag PATTERN "
                        "(repeatable, comma-separated; any match keeps the case)")
    p.add_argument("--list", action="store_true", help="list the selected cases with their tags and exit")
    p.add_argument("--seed", type=int, default=0, help="seed of the sweeps' sampling and of all data (default 0)")
    p.add_argument("--report", metavar="DIR", help="write DIR/parity.json (strict JSON: non-finite numbers as the strings \"inf\", \"-inf\", \"nan\") and DIR/parity.md")
    p.add_argument("--fail-fast", action="store_true", help="stop after the first case with a failure")
    p.add_argument("--jobs", type=int, metavar="N",
                   help="worker processes running cases side by side (default: half the CPU cores, "
                        "at most 8, on a GPU; at most 2 without one). Each worker compiles its own kernels")
    p.add_argument("--no-progress", action="store_true", help="no progress output on stderr")
    p.add_argument("--fuzz", type=int, metavar="N",
                   help="instead of the catalog, run N random valid cases drawn from --seed (parity.catalog.fuzz); "
                        "each failure is shrunk to a simpler case that still fails and printed as a one-line repro")
    p.add_argument("--shrink-budget", type=int, default=40, metavar="RUNS",
                   help="trial runs the fuzzer may spend shrinking each failure (default 40)")
    p.add_argument("--case", action="append", metavar="JSON",
                   help="instead of the catalog, run the case given as a JSON object of AttentionCase fields "
                        "(what a fuzz repro prints; repeatable)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    has_gpu = environment.configure()  # before anything imports triton or jax
    mode = "quick" if args.quick else "full" if args.full else ("full" if has_gpu else "quick")

    from ..catalog.catalog import build_catalog, select
    from ..legs import LEG_NAMES, SELF_TEST_LEGS, load_leg

    legs = _split([args.legs])
    known = LEG_NAMES + SELF_TEST_LEGS
    unknown = [n for n in legs if n not in known]
    if unknown or not legs:
        print(f"parity: --legs: expected some of {', '.join(LEG_NAMES)} (self-test legs: "
              f"{', '.join(SELF_TEST_LEGS)}), got {args.legs!r}", file=sys.stderr)
        return 2
    legs = [n for n in known if n in legs]  # canonical order, no duplicates
    if args.jobs is not None and args.jobs < 1:
        print(f"parity: --jobs: expected a positive number of worker processes, got {args.jobs}", file=sys.stderr)
        return 2
    patterns = _split(args.filter)
    if args.fuzz is not None and args.fuzz < 1:
        print(f"parity: --fuzz: expected a positive number of cases, got {args.fuzz}", file=sys.stderr)
        return 2
    if args.fuzz is not None or args.case:
        from ..catalog.fuzz import fuzz_cases, parse_case_spec

        try:
            pool = [parse_case_spec(c) for c in args.case or ()]
        except ValueError as e:
            print(f"parity: {e}", file=sys.stderr)
            return 2
        if args.fuzz is not None:
            pool += fuzz_cases(args.fuzz, args.seed, mode)
        cases = select(pool, patterns)
        source = f"--fuzz {args.fuzz}" if args.fuzz is not None else "--case"
    else:
        cases = select(build_catalog(mode, args.seed), patterns)
        source = f"{mode} catalog"

    if args.list:
        for c in cases:
            print(f"{c.id}  [{', '.join(sorted(c.all_tags))}]")
        print(f"{len(cases)} case(s) in the {source} (seed {args.seed})")
        return 0
    if not cases:
        print(f"parity: no case of the {source} matches --filter {patterns}", file=sys.stderr)
        return 2

    from .progress import Progress
    from ..report.report import console_report, write_reports
    from .parallel import default_jobs, run_cases
    from .runner import Options

    loaded = [load_leg(n) for n in legs]
    legs_text = [leg.describe() for leg in loaded]
    print(f"parity: {source}, {len(cases)} case(s), seed {args.seed}, legs {','.join(legs)}", file=sys.stderr)
    for t in legs_text:
        print(f"  {t}", file=sys.stderr)
    progress = Progress(enabled=not args.no_progress)
    options = Options(mode=mode, seed=args.seed, fail_fast=args.fail_fast, has_gpu=has_gpu)
    jobs = min(args.jobs or default_jobs(has_gpu), len(cases))
    if jobs > 1:
        print(f"  {jobs} worker processes", file=sys.stderr)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    previous = signal.signal(signal.SIGTERM, _terminate)  # `timeout` and CI cancels: keep partial results
    try:
        records, interrupted = run_cases(legs, options, cases, jobs, on_case=progress, legs=loaded)
    finally:
        signal.signal(signal.SIGTERM, previous)
    seconds = time.perf_counter() - t0
    print(f"parity: {source} ran in {seconds:.0f}s wall time on {jobs} worker process(es)", file=sys.stderr)
    shrunk = []
    if args.fuzz is not None and not interrupted:
        shrunk = _shrink_failures(cases, records, loaded, options, args.shrink_budget)
    print(console_report(records, legs_text, interrupted=interrupted))
    for line in shrunk:
        print(line)
    if args.report:
        meta = {"mode": mode, "seed": args.seed, "legs": legs, "jobs": jobs, "filter": patterns, "started": started,
                "seconds": round(seconds, 1), "legs_text": legs_text, "versions": environment.versions(),
                "argv": sys.argv if argv is None else ["python", "-m", "parity", *argv]}
        if interrupted:
            meta["interrupted"] = interrupted
        if shrunk:
            meta["shrunk_repros"] = shrunk
        paths = write_reports(args.report, records, meta=meta, cases=cases)
        print(f"reports: {', '.join(paths)}", file=sys.stderr)
    if any(r.status == "failed" for r in records):
        return 1
    return 130 if interrupted else 0


def _shrink_failures(cases, records, legs, options, budget: int) -> list[str]:
    """Shrinks each failed fuzz case (in this process); one line per case with its simplest repro."""
    from ..catalog.fuzz import shrink
    from ..report.records import FAILED
    from .runner import Runner, repro_for

    failed_ids = {r.case_id for r in records if r.status == FAILED}
    out = []
    for case in cases:
        if case.id not in failed_ids:
            continue
        names = sorted({n for r in records if r.case_id == case.id and r.status == FAILED for n in (r.legs or (r.leg,))}
                       & {leg.name for leg in legs})
        use = [leg for leg in legs if leg.name in names] or list(legs)
        runner = Runner(use, options)

        def fails(c) -> bool:
            return any(r.status == FAILED for r in runner.run_one(c))

        print(f"parity: shrinking {case.id} (legs {','.join(leg.name for leg in use)})", file=sys.stderr)
        small, runs = shrink(case, fails, budget=budget,
                             log=lambda m: print(f"  {m}", file=sys.stderr))
        runner.close()
        out.append(f"shrunk ({runs} trial runs) {case.id} -> {small.id}\n  repro: "
                   + repro_for(small, options.mode, options.seed, [leg.name for leg in use]))
    return out


def _terminate(signum, frame):
    # Once: timeout(1) signals the whole process group, and a second SIGTERM arriving during
    # the clean-up would abort it before the partial report is written.
    signal.signal(signum, signal.SIG_IGN)
    raise KeyboardInterrupt
