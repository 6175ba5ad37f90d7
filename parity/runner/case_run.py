"""One attention case's shared state while its comparisons run.

`CaseRun` builds the reference results once (the cache the reference
writes, the float64 output on it, the emulation that sizes tolerances, the
dense raw-K/V output) and what each leg produced, so every comparison of the
case reuses them. Leg calls that raise become `LegError`s, which the checks
turn into failed records (a broken kernel never aborts the run).
"""

from __future__ import annotations

import inspect
import time
import traceback
from typing import Optional

import numpy as np

import tq_spec
from tq_spec import reference

from .. import tolerances
from ..catalog.problem import Problem
from ..checks.dense import dense_attention
from ..legs.base import Leg
from ..report.records import FAILED, Record

_ACCEPTS_EMULATION = "emulation" in inspect.signature(tolerances.check_attention).parameters


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()


def _tb(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])


class LegError(Exception):
    """A leg call raised; carries the original exception for the record."""

    def __init__(self, what: str, error: BaseException):
        super().__init__(f"{what} raised {_error_text(error)}")
        self.error = error


class CaseRun:
    """One case's shared state: problem, reference results, per-leg results."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.case = problem.case
        pr = problem
        with np.errstate(all="ignore"):
            self.ref_cache = reference.store_kv(pr.key, pr.value, pr.cache_before, pr.slot_mapping,
                                                **pr.store_kwargs())
        self.attn_cache = pr.hide(self.ref_cache)
        self._ref_out: Optional[np.ndarray] = None
        self.stored: dict[str, object] = {}  # leg -> numpy cache, or LegError
        self.outputs: dict[str, dict[str, tuple]] = {}  # leg -> path -> (out, comparison)
        self._dev_args: dict[str, tuple] = {}
        self._dense: Optional[np.ndarray] = None
        self._emulations: dict[str, object] = {}

    # -- reference side --------------------------------------------------------------

    @property
    def ref_out(self) -> np.ndarray:
        if self._ref_out is None:
            with np.errstate(all="ignore"):
                self._ref_out = reference.paged_attention(
                    self.problem.query, self.attn_cache, *self.problem.attention_args()[1:],
                    **self.problem.attention_kwargs())
        return self._ref_out

    def reference_on(self, cache: np.ndarray) -> Optional[np.ndarray]:
        """The reference output on `cache` if it is the reference's own bytes, else None."""
        return self.ref_out if np.array_equal(cache, self.attn_cache) else None

    @property
    def dense(self) -> np.ndarray:
        if self._dense is None:
            c, pr = self.case, self.problem
            self._dense = dense_attention(pr.seq_queries, pr.seq_keys, pr.seq_values, scale=c.scale,
                                          sliding_window=c.sliding_window,
                                          logits_soft_cap=c.logits_soft_cap, sinks=pr.sinks)
        return self._dense

    def dispatch_problem(self) -> tq_spec.dispatch.DispatchProblem:
        c = self.case
        return tq_spec.dispatch.DispatchProblem(
            num_tokens=c.num_tokens, num_seqs=len(c.seqs), num_q_heads=c.num_q_heads,
            num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, block_size=c.block_size,
            preset=c.preset, sliding_window=c.sliding_window, query_dtype=c.dtype,
            max_blocks=int(self.problem.block_table.shape[1]))

    # -- leg side --------------------------------------------------------------------

    def dev_args(self, leg: Leg) -> tuple:
        """``(query, block_table, seq_lens, query_start_loc, sinks)`` on the leg, uploaded once."""
        if leg.name not in self._dev_args:
            pr = self.problem
            self._dev_args[leg.name] = tuple(leg.put(a) for a in pr.attention_args()) + (
                None if pr.sinks is None else leg.put(pr.sinks),)
        return self._dev_args[leg.name]

    def attend(self, leg: Leg, cache, path: str) -> np.ndarray:
        """Leg attention over a cache (numpy, or already on the leg) -> numpy output."""
        q, bt, sl, qsl, sinks = self.dev_args(leg)
        kw = self.problem.attention_kwargs()
        kw["sinks"] = sinks
        dev_cache = leg.put(cache) if isinstance(cache, np.ndarray) else cache
        try:
            splits = split_count(path)
            if splits is not None:
                out = leg.paged_attention_splits(q, dev_cache, bt, sl, qsl, num_splits=splits, **kw)
            else:
                out = leg.paged_attention(q, dev_cache, bt, sl, qsl, path=path, **kw)
            return leg.get(out)
        except Exception as e:
            raise LegError(f"{leg.name}.paged_attention(path={path!r})", e) from e

    def auto_output(self, leg: Leg, cache: np.ndarray) -> tuple[np.ndarray, bool]:
        """Leg auto-path output over `cache`; (output, reused).

        Kernels are deterministic, so when `cache` holds exactly the bytes the
        attention check already ran on, its auto output is reused instead of
        recomputed (saves most interchange/e2e work when stores agree).
        """
        prev = self.outputs.get(leg.name, {}).get(self.auto_path(leg))
        if prev is not None and np.array_equal(cache, self.attn_cache):
            return prev[0], True
        return self.attend(leg, cache, "auto"), False

    def auto_path(self, leg: Leg) -> str:
        """Key of the leg's auto output in `outputs`: ``auto`` if it ran, else the path auto selects."""
        outs = self.outputs.get(leg.name, {})
        if "auto" in outs:
            return "auto"
        return tq_spec.dispatch.select_path(self.dispatch_problem())

    def store(self, leg: Leg) -> np.ndarray:
        """The leg's one-shot store of every token (memoised; raises LegError)."""
        if leg.name not in self.stored:
            pr = self.problem
            try:
                out = leg.store_kv(leg.put(pr.key), leg.put(pr.value), leg.put(pr.cache_before),
                                   leg.put(pr.slot_mapping), **pr.store_kwargs())
                self.stored[leg.name] = leg.get(out)
            except Exception as e:
                self.stored[leg.name] = LegError(f"{leg.name}.store_kv", e)
        got = self.stored[leg.name]
        if isinstance(got, LegError):
            raise got
        return got

    def compare(self, leg: Leg, out: np.ndarray, cache: np.ndarray, ref_out=None):
        """`tolerances.check_attention` of a leg output computed over `cache`.

        On the reference's own bytes the reference output and (where
        `check_attention` accepts it) the emulation are computed once per
        case and compute dtype, not once per leg x path.
        """
        pr = self.problem
        kw = pr.attention_kwargs()
        compute = leg.compute_dtype(self.case.dtype)
        same = np.array_equal(cache, self.attn_cache)
        if ref_out is None and same:
            ref_out = self.ref_out
        if same and _ACCEPTS_EMULATION:
            kw["emulation"] = self._emulation(compute or self.case.dtype)
        with np.errstate(all="ignore"):
            return tolerances.check_attention(
                out, pr.query, cache, *pr.attention_args()[1:], compute_dtype=compute, reference_out=ref_out, **kw)

    def _emulation(self, compute_dtype: str):
        if compute_dtype not in self._emulations:
            pr = self.problem
            with np.errstate(all="ignore"):
                self._emulations[compute_dtype] = tolerances.emulate(
                    pr.query, self.attn_cache, *pr.attention_args()[1:], compute_dtype=compute_dtype,
                    **pr.attention_kwargs())
        return self._emulations[compute_dtype]

    def record(self, op: str, leg: str, path: str, status: str, detail: str = "", *, legs=(), **extra) -> Record:
        return Record(case_id=self.case.id, op=op, leg=leg, path=path, preset=self.case.preset,
                      status=status, detail=detail, legs=tuple(legs) or (leg,), **extra)


SPLITS_PREFIX = "decode/splits="


def split_path(n: int) -> str:
    """The path name of the decode path forced to `n` splits."""
    return f"{SPLITS_PREFIX}{n}"


def split_count(path: str):
    """`n` for a ``decode/splits=n`` path, else None."""
    return int(path[len(SPLITS_PREFIX):]) if path.startswith(SPLITS_PREFIX) else None


def attention_metrics(cmp) -> dict:
    return {"max_err": cmp.max_err, "bound": cmp.bound, "emulated_err": cmp.emulated_err,
            "nonfinite": cmp.nonfinite}


def timed(fn):
    t0 = time.perf_counter()
    recs = fn()
    dt = time.perf_counter() - t0
    recs = recs if isinstance(recs, list) else [recs]
    for r in recs:
        if not r.seconds:
            r.seconds = dt / len(recs)
    return recs


def failed_by(run: CaseRun, op: str, leg: str, path: str, e: BaseException, legs=()) -> Record:
    root = e.error if isinstance(e, LegError) else e
    return run.record(op, leg, path, FAILED, str(e) if isinstance(e, LegError) else f"harness error: {_error_text(e)}",
                      legs=legs, metrics={"traceback": _tb(root)})
