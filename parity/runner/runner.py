"""Runs cases through legs and collects `Record`s.

For every case: build the problem once, compute the reference once, then run
each requested comparison for each available leg (and each pair of kernel
legs). Legs that cannot run here produce ``unavailable`` records for every
comparison they would have taken part in, so a missing leg is visible in
every summary line and never counts as passed.
"""

from __future__ import annotations

import shlex
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

import tq_spec

from .case_run import CaseRun, split_path
from ..catalog.cases import AttentionCase, Case, ErrorCase, ModelCase
from ..catalog.problem import build_problem
from ..checks.attention import check_attention
from ..checks.chunking import check_chunking
from ..checks.cuda_graph import check_cuda_graph
from ..checks.determinism import check_determinism
from ..checks.distortion import check_e2e
from ..checks.model import check_model, layer_runs
from ..checks.pairs import check_cross, check_cross_store, check_interchange
from ..checks.paths import check_paths
from ..checks.store import check_store
from ..legs.base import Unavailable
from ..report.records import FAILED, SKIPPED, UNAVAILABLE, XFAILED, Record

# Which contract ops each comparison needs from a (single) leg.
_NEEDS = {
    "store": ("store_kv",),
    "attention": ("paged_attention",),
    "paths": ("paged_attention",),
    "e2e": ("store_kv", "paged_attention"),
    "chunking": ("store_kv", "paged_attention"),
    "model": ("store_kv", "paged_attention"),
    "determinism": ("paged_attention",),
    "cuda-graph": ("paged_attention",),
}
_ORACLE_CHECKS = ("e2e", "chunking")  # the reference compared with itself elsewhere is vacuous
_PAIR_CHECKS = {  # check -> (op name in records, writer needs, reader needs)
    "cross": (("cross", ("paged_attention",)), ("cross-store", ("store_kv",))),
    "interchange": (("interchange", None),),
}


@dataclass
class Options:
    """How to run: catalog mode (for the repro line), seed, fail-fast, GPU presence."""

    mode: str = "quick"
    seed: int = 0
    fail_fast: bool = False
    has_gpu: bool = False
    # False (default): "auto" runs, and stands in for the path it selects (that
    # path is not forced a second time: same kernel, same inputs); every other
    # eligible path is forced with path=. So every eligible path runs on every
    # case, and the leg's own dispatch is exercised too. True also forces the
    # selected path by name (one more compile per case on JAX).
    force_auto_choice: bool = False


def apply_known(records: list[Record], case) -> list[Record]:
    """A case's known failures (``case.known``: (leg, reason) pairs), as pytest's strict xfail.

    Every failed record the leg takes part in becomes ``xfailed`` with the reason; if none failed,
    one failed ``xpassed`` record says the mark must go.
    """
    for leg, reason in getattr(case, "known", ()) or ():
        mine = [r for r in records if leg in (r.legs or (r.leg,))]
        failed = [r for r in mine if r.status == FAILED]
        for r in failed:
            r.status = XFAILED
            r.detail = f"known failure ({reason}): {r.detail}"
            r.metrics = {**r.metrics, "known": reason}
        if not failed and mine:
            records.append(Record(case.id, "case", leg, "-", getattr(case, "preset", "mixed"), FAILED,
                                  f"xpassed: the known failure of {leg} no longer happens ({reason}); remove it "
                                  "from the case's `known` (parity/catalog/catalog.py)", legs=(leg,)))
    return records


def repro_line(mode: str, case_id: str, seed: int, legs: Sequence[str]) -> str:
    """The one-line command that re-runs one case."""
    return (f"python -m parity --{mode} --filter {shlex.quote(case_id)} --seed {seed} "
            f"--legs {','.join(legs)}")


# Groups of cases that are not in any catalog (fuzzer draws, --case specs): their repro names the case.
SPEC_GROUPS = ("fuzz", "case")


def repro_for(case, mode: str, seed: int, legs: Sequence[str]) -> str:
    """`repro_line`, or for a case outside the catalogs ``python -m parity --case '<json>' ...``."""
    if getattr(case, "group", "") in SPEC_GROUPS and isinstance(case, AttentionCase):
        from ..catalog.fuzz import case_spec

        return f"python -m parity --case {shlex.quote(case_spec(case))} --seed {seed} --legs {','.join(legs)}"
    return repro_line(mode, case.id, seed, legs)


class Runner:
    """Runs cases through `legs` (loaded `Leg`s or `Unavailable`s)."""

    def __init__(self, legs: Sequence, options: Options,
                 on_case: Optional[Callable[[int, int, Case, list], None]] = None):
        self.legs = list(legs)
        self.options = options
        self.on_case = on_case
        self._errors = None  # parity.checks.errors.ErrorsRunner: sandbox children, started on first use

    @property
    def kernel_legs(self) -> list:
        return [leg for leg in self.legs if not leg.oracle]

    def run(self, cases: Sequence[Case]) -> list[Record]:
        """Runs `cases` in order. On KeyboardInterrupt (Ctrl-C, or SIGTERM mapped to it by the
        CLI) stops after the records gathered so far and sets `interrupted`."""
        out: list[Record] = []
        self.interrupted = ""
        try:
            self._run(cases, out)
        except KeyboardInterrupt:
            done = len({r.case_id for r in out})
            self.interrupted = f"interrupted: {done} of {len(cases)} case(s) ran; the rest did not"
        return out

    def _run(self, cases: Sequence[Case], out: list) -> None:
        for i, case in enumerate(cases):
            t0 = time.perf_counter()
            recs = self.run_one(case)
            out += recs
            if self.on_case is not None:
                self.on_case(i + 1, len(cases), case, recs, time.perf_counter() - t0)
            if self.options.fail_fast and any(r.status == FAILED for r in recs):
                break

    def run_one(self, case: Case) -> list[Record]:
        """`run_case`, with the repro line set on every failed record."""
        recs = self.run_case(case)
        for r in recs:
            if r.status == FAILED:
                r.repro = repro_for(case, self.options.mode, self.options.seed, r.legs or (r.leg,))
        return recs

    def run_case(self, case: Case) -> list[Record]:
        if case.gpu_only and not self.options.has_gpu:
            reason = "gpu-only case (needs a CUDA device; e.g. a cache over 2 GiB): no GPU here"
            return [Record(case.id, "case", leg.name, "-", getattr(case, "preset", "mixed"), SKIPPED, reason,
                           legs=(leg.name,)) for leg in self.legs]
        try:
            with np.errstate(all="ignore"):
                if isinstance(case, ModelCase):
                    return self._run_model(case)
                if isinstance(case, ErrorCase):
                    return self._run_errors(case)
                return self._run_attention(case)
        except Exception as e:  # a harness bug must fail loudly, with the case id
            return [Record(case.id, "case", "harness", "-", getattr(case, "preset", "mixed"), FAILED,
                           f"harness error: {type(e).__name__}: {e}",
                           metrics={"traceback": traceback.format_exc()[-3000:]},
                           legs=tuple(leg.name for leg in self.legs))]

    # -- availability -----------------------------------------------------------------

    @staticmethod
    def _lacks(leg, ops) -> Optional[str]:
        if isinstance(leg, Unavailable):
            return leg.reason
        missing = [op for op in (ops or ()) if op not in leg.ops]
        if missing:
            return f"{leg.name} leg has no {', '.join(missing)}"
        return None

    def _unavailable(self, case_id, op, leg_name, path, preset, reason, legs) -> Record:
        return Record(case_id, op, leg_name, path, preset, UNAVAILABLE, reason, legs=tuple(legs))

    # -- attention cases ----------------------------------------------------------------

    def _run_attention(self, case: AttentionCase) -> list[Record]:
        run = CaseRun(build_problem(case, self.options.seed))
        recs: list[Record] = []
        for leg in self.legs:
            for check in case.checks:
                if check in _PAIR_CHECKS or check not in _NEEDS or check == "determinism":
                    continue
                if leg.oracle and check not in _ORACLE_CHECKS:
                    continue
                reason = self._lacks(leg, _NEEDS[check])
                if reason is not None:
                    recs.append(self._unavailable(case.id, check, leg.name, "-", case.preset, reason, (leg.name,)))
                    continue
                if check == "store":
                    recs += check_store(run, leg)
                elif check == "attention":
                    recs += check_attention(run, leg, self._paths(run, leg))
                elif check == "paths":
                    recs += check_paths(run, leg)
                elif check == "e2e":
                    recs += check_e2e(run, leg)
                elif check == "chunking":
                    recs += check_chunking(run, leg, case.chunks)
                elif check == "cuda-graph":
                    recs += check_cuda_graph(run, leg)
        recs += self._pairs(case, run)
        if "determinism" in case.checks:  # after every check, so it repeats each path they ran
            for leg in self.kernel_legs:
                if self._lacks(leg, _NEEDS["determinism"]) is None:
                    recs += check_determinism(run, leg)
        return apply_known(recs, case)

    def _paths(self, run, leg) -> tuple[str, ...]:
        paths = leg.paths(run.dispatch_problem())
        if run.case.decode_splits and "decode" in paths and leg.supports_splits:
            paths = paths + tuple(split_path(n) for n in run.case.decode_splits)
        if self.options.force_auto_choice or "auto" not in paths:
            return paths
        chosen = tq_spec.dispatch.select_path(run.dispatch_problem())
        return tuple(p for p in paths if p != chosen)

    def _pairs(self, case: AttentionCase, run) -> list[Record]:
        recs: list[Record] = []
        kernel = self.kernel_legs
        for check in case.checks:
            if check not in _PAIR_CHECKS:
                continue
            if check == "cross":
                pairs = [(a, b) for i, a in enumerate(kernel) for b in kernel[i + 1:]]
            else:
                pairs = [(a, b) for a in kernel for b in kernel if a is not b]
            for a, b in pairs:
                for op, _ in _PAIR_CHECKS[check]:
                    if op == "cross-store" and "store" not in case.checks:
                        continue  # the case skips stores (quick mode economy)
                    name = f"{a.name}->{b.name}" if check == "interchange" else f"{a.name}|{b.name}"
                    need_a = ("store_kv",) if op in ("interchange", "cross-store") else ("paged_attention",)
                    need_b = ("paged_attention",) if op in ("interchange", "cross") else ("store_kv",)
                    reason = self._lacks(a, need_a) or self._lacks(b, need_b)
                    if reason is not None:
                        recs.append(self._unavailable(case.id, op, name, "-", case.preset, reason, (a.name, b.name)))
                    elif op == "cross":
                        recs += check_cross(run, a, b)
                    elif op == "cross-store":
                        recs += check_cross_store(run, a, b)
                    else:
                        recs += check_interchange(run, a, b)
        return recs

    # -- bad inputs ---------------------------------------------------------------------------

    def _run_errors(self, case: ErrorCase) -> list[Record]:
        from ..catalog.bad_inputs import row_by_id
        from ..checks.errors import ErrorsRunner, check_errors

        row = row_by_id(case.row_id)
        recs: list[Record] = []
        names = []
        for leg in self.kernel_legs:
            if leg.name not in ("torch", "jax") or leg.name not in row.legs:
                continue
            if isinstance(leg, Unavailable):
                recs.append(self._unavailable(case.id, "errors", leg.name, "-", case.preset, leg.reason, (leg.name,)))
                continue
            names.append(leg.name)
        if not names and not recs:
            return [Record(case.id, "errors", "-", "-", case.preset, SKIPPED,
                           "the errors check runs the torch and jax legs only (none selected for this row)")]
        if self._errors is None:
            self._errors = ErrorsRunner(self.options.seed)
        return recs + check_errors(row, names, self._errors, case.id, case.preset)

    def close(self) -> None:
        """Ends helper processes (the errors check's sandboxes)."""
        if self._errors is not None:
            self._errors.close()
            self._errors = None

    # -- model cases ------------------------------------------------------------------------

    def _run_model(self, case: ModelCase) -> list[Record]:
        runs = layer_runs(case, self.options.seed)
        recs: list[Record] = []
        for leg in self.kernel_legs:
            reason = self._lacks(leg, _NEEDS["model"])
            if reason is not None:
                recs.append(self._unavailable(case.id, "model", leg.name, "-", "mixed", reason, (leg.name,)))
                continue
            recs += check_model(case, runs, leg)
        return recs
