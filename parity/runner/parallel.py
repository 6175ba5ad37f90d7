"""Runs a catalog across worker processes (``--jobs N``).

A full GPU run is dominated by compilation: every distinct shape compiles
its Triton and Pallas kernels once, which is CPU work done one kernel at a
time in a single process. Worker processes compile different cases at the
same time and share the GPU for the (short) launches.

Each worker loads its own legs (by name) and runs whole cases with the same
`Runner` as the serial mode, so a case's records are identical whichever
worker ran it; the records come back sorted in catalog order. Workers are
started with ``spawn`` (CUDA cannot be used from a forked child) and ignore
SIGINT: the parent owns interruption, and on Ctrl-C / SIGTERM it cancels the
queued cases, terminates the workers and keeps what finished. A worker that
dies (a segfault in a kernel, out of memory) fails the cases it had not
returned, with that reason, instead of hanging the run.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Optional, Sequence

from ..catalog.cases import Case, ModelCase
from ..report.records import FAILED, Record

_worker_runner = None  # this worker process's Runner (set by _init_worker)


def default_jobs(has_gpu: bool) -> int:
    """Workers for a run. On a GPU machine about half the CPU cores, at most 8: a worker's
    compiles use a thread or two and its launches are short. Without a GPU at most 2: the
    interpreters are CPU-bound, and each worker holds its own torch and jax (over 1 GiB)."""
    cores = os.cpu_count() or 1
    if not has_gpu:
        return min(2, cores)
    return max(1, min(8, cores // 2))


def cost_order(cases: Sequence[Case]) -> list[int]:
    """Indices of `cases`, heaviest first, so a long case does not start last and leave the
    other workers idle (gpu-only far-page caches, then model and chunking cases)."""

    def weight(case) -> int:
        if case.gpu_only:
            return 3
        if isinstance(case, ModelCase) or "chunking" in getattr(case, "checks", ()):
            return 2
        return 1

    return sorted(range(len(cases)), key=lambda i: -weight(cases[i]))


def _init_worker(leg_names: Sequence[str], options) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from . import environment

    environment.configure(options.has_gpu)  # before the legs import triton / jax
    from ..legs import load_leg
    from .runner import Runner

    global _worker_runner
    _worker_runner = Runner([load_leg(n) for n in leg_names], options)


def _run_in_worker(index: int, case: Case) -> tuple[int, list[Record], float]:
    t0 = time.perf_counter()
    records = _worker_runner.run_one(case)
    return index, records, time.perf_counter() - t0


def _died(case: Case, leg_names: Sequence[str], why: str) -> list[Record]:
    return [Record(case.id, "case", "harness", "-", getattr(case, "preset", "mixed"), FAILED,
                   f"worker process died before returning this case: {why}", legs=tuple(leg_names))]


def run_parallel(leg_names: Sequence[str], options, cases: Sequence[Case], jobs: int,
                 on_case: Optional[Callable] = None) -> tuple[list[Record], str]:
    """Runs `cases` on `jobs` worker processes; returns (records in catalog order, interrupted).

    `interrupted` is "" for a complete run, else a sentence saying how many cases ran.
    `on_case(done, total, case, records, seconds)` is called in completion order.
    """
    results: dict[int, list[Record]] = {}
    interrupted = ""
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=context, initializer=_init_worker,
                               initargs=(tuple(leg_names), options))
    pending = {}

    def collect(future, i) -> list[Record]:
        try:
            _, records, seconds = future.result()
        except BrokenProcessPool as e:
            records, seconds = _died(cases[i], leg_names, str(e) or "the pool broke"), 0.0
        results[i] = records
        if on_case is not None:
            on_case(len(results), len(cases), cases[i], records, seconds)
        return records

    try:
        for i in cost_order(cases):
            pending[pool.submit(_run_in_worker, i, cases[i])] = i
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            failed = False
            for future in done:
                failed |= any(r.status == FAILED for r in collect(future, pending.pop(future)))
            if failed and options.fail_fast:
                # Queued cases are dropped; the ones already running finish and are kept.
                running = {f: i for f, i in pending.items() if not f.cancel()}
                for future, i in running.items():
                    collect(future, i)
                pending = {}
    except KeyboardInterrupt:
        interrupted = f"interrupted: {len(results)} of {len(cases)} case(s) ran; the rest did not"
        # The pool cancels the queued cases itself (cancelling them here races its manager
        # thread); the running ones are stopped by terminating the workers.
        pool.shutdown(wait=False, cancel_futures=True)
        for child in multiprocessing.active_children():
            child.terminate()
    finally:
        pool.shutdown(wait=not interrupted, cancel_futures=True)
    records = [r for i in sorted(results) for r in results[i]]
    return records, interrupted


def run_cases(leg_names: Sequence[str], options, cases: Sequence[Case], jobs: int = 1,
              on_case: Optional[Callable] = None, legs: Optional[Sequence] = None) -> tuple[list[Record], str]:
    """Runs `cases` in this process (``jobs == 1``, with `legs` if already loaded) or on `jobs`
    workers; returns (records in catalog order, interrupted), as `run_parallel`."""
    if jobs > 1:
        return run_parallel(leg_names, options, cases, jobs, on_case=on_case)
    from ..legs import load_leg
    from .runner import Runner

    runner = Runner(list(legs) if legs is not None else [load_leg(n) for n in leg_names], options,
                    on_case=on_case)
    try:
        records = runner.run(cases)
    finally:
        runner.close()
    return records, runner.interrupted
