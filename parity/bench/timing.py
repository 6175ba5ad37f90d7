"""How things are timed (the numbers' definitions live here and nowhere else).

Three measures, all in milliseconds per call, compile time excluded:

* ``event``: torch only, on a GPU. `triton.testing.do_bench`: L2 flushed
  before every call, CUDA events around the call, median and the 20/80 %
  quantiles. This is device time of the eager call.
* ``graph``: torch only, on a GPU, small shapes. `do_bench_cudagraph`: the
  call captured in a CUDA graph and replayed, so launch overhead is gone.
* ``loop``: every callable (torch, jax, baselines) the same way: N calls issued
  back to back, then one sync, wall time / N; repeated and summarised by the
  median and the min/max over repeats. While the device is busier than the
  host this is device throughput; for tiny kernels it includes the host's
  dispatch cost, which is part of what a caller pays. It is the one measure
  that treats torch and jax alike (jax has no events around its calls), so
  the jax/torch ratio and jax speed-ups use it.

``host_us``: host wall time of issuing one eager call (the loop's issue time
without the final sync, per call): the launch overhead a caller pays.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

LOOP_TARGET_S = 0.03  # wall time of one repeat of the loop measure
LOOP_REPEATS = 7
MAX_LOOP_CALLS = 200
CALIBRATION_CALLS = 5  # calls of the warm loop that sizes the loop measure


@dataclass
class Spread:
    """Median and spread of one measure, milliseconds per call."""

    median_ms: float
    low_ms: float
    high_ms: float
    how: str = ""  # which quantiles low/high are

    def to_dict(self) -> dict:
        return {"median_ms": self.median_ms, "low_ms": self.low_ms, "high_ms": self.high_ms, "how": self.how}


@dataclass
class Timing:
    """Every measure taken of one callable; None where not taken (and `notes` says why)."""

    loop: Optional[Spread] = None
    event: Optional[Spread] = None
    graph: Optional[Spread] = None
    host_us: Optional[float] = None
    compile_s: Optional[float] = None
    notes: list[str] = field(default_factory=list)

    def best_ms(self, prefer: str = "event") -> Optional[float]:
        """The headline time: `prefer` if taken, else the loop median."""
        s = getattr(self, prefer, None) or self.loop
        return None if s is None else s.median_ms

    def to_dict(self) -> dict:
        return {
            "loop": self.loop and self.loop.to_dict(), "event": self.event and self.event.to_dict(),
            "graph": self.graph and self.graph.to_dict(), "host_us": self.host_us,
            "compile_s": self.compile_s, "notes": list(self.notes),
        }


def loop_time(call: Callable[[], object], sync: Callable[[], None], *, smoke: bool = False) -> tuple[Spread, float]:
    """The ``loop`` measure and ``host_us`` of `call` (already warmed up / compiled).

    `call` issues one op and returns its result; `sync(result)` waits for the device.
    """
    if smoke:  # interpreters: one call shows the path runs; its time means nothing
        n, repeats = 1, 1
    else:
        # The call count comes from a short warm loop, not from one call: a first call can
        # take many times longer (lazy initialisation, a device still busy with the
        # correctness check), which left 2-4 calls per repeat and a noisy median.
        sync(call())
        t0 = time.perf_counter()
        for _ in range(CALIBRATION_CALLS):
            last = call()
        sync(last)
        one = (time.perf_counter() - t0) / CALIBRATION_CALLS
        n, repeats = max(1, min(MAX_LOOP_CALLS, int(LOOP_TARGET_S / max(one, 1e-6)))), LOOP_REPEATS
    per_call, issue = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            last = call()  # earlier results may be freed: both allocators reuse memory in stream order
        t1 = time.perf_counter()
        sync(last)
        t2 = time.perf_counter()
        per_call.append((t2 - t0) / n * 1e3)
        issue.append((t1 - t0) / n * 1e6)
    return (Spread(statistics.median(per_call), min(per_call), max(per_call), f"min/max of {repeats}x{n} calls"),
            statistics.median(issue))


def event_time(fn: Callable[[], object]) -> Spread:
    """``event``: `triton.testing.do_bench` (L2 flushed, CUDA events), median and 20/80 % quantiles."""
    import triton.testing

    lo, med, hi = triton.testing.do_bench(fn, warmup=10, rep=60, quantiles=[0.2, 0.5, 0.8])
    return Spread(float(med), float(lo), float(hi), "p20/p80 (do_bench)")


def graph_time(fn: Callable[[], object]) -> Spread:
    """``graph``: `triton.testing.do_bench_cudagraph` (the call replayed from a CUDA graph)."""
    import triton.testing

    lo, med, hi = triton.testing.do_bench_cudagraph(fn, rep=30, quantiles=[0.2, 0.5, 0.8])
    return Spread(float(med), float(lo), float(hi), "p20/p80 (do_bench_cudagraph)")


def torch_timing(fn: Callable[[], object], *, on_gpu: bool, graph: bool, smoke: bool = False) -> Timing:
    """Every measure of a torch callable: loop + host overhead always; event and graph on a GPU."""
    import torch

    def sync(_):
        if on_gpu:
            torch.cuda.synchronize()

    t = Timing()
    t.loop, t.host_us = loop_time(fn, sync, smoke=smoke)
    if not on_gpu:
        t.notes.append("no GPU: event/graph timing not taken")
        return t
    t.event = event_time(fn)
    if graph:
        try:
            t.graph = graph_time(fn)
        except Exception as e:  # a path that syncs or allocates cannot be captured: say so
            t.notes.append(f"graph capture failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            torch.cuda.synchronize()
    return t


def jax_timing(call: Callable[[], object], *, compile_s: float, smoke: bool = False) -> Timing:
    """Loop measure of an AOT-compiled jax call (each result ended by ``block_until_ready``)."""
    import jax

    t = Timing(compile_s=compile_s)
    t.loop, t.host_us = loop_time(call, jax.block_until_ready, smoke=smoke)
    return t


def aot_compile(fn, *args, **jit_kwargs):
    """``jax.jit(fn, **jit_kwargs).lower(*args).compile()`` and the seconds it took."""
    import jax

    t0 = time.perf_counter()
    compiled = jax.jit(fn, **jit_kwargs).lower(*args).compile()
    return compiled, time.perf_counter() - t0
