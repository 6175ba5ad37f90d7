"""Kernel launches with little host time: a `KernelSite` relaunches the kernels Triton compiled.

A ``JITFunction[grid](...)`` call binds and specialises every argument on
each call. On the H100 bench host that costs 11 to 16 us for a one-argument
kernel and 25 to 41 us for a 40-argument one (one eager ``torch.Tensor.add_``
costs 7 to 11 us there; the spread is between machines of one kind), while
the three kernels of a B=1 decode run for about 15 us in all. A `KernelSite` keeps the ``CompiledKernel`` that Triton returns from the
first launch of each specialisation and relaunches it through its launcher
(``CompiledKernel.run``, which packs the arguments for the driver: what
``CompiledKernel[grid]`` calls, less the launch metadata that only launch
hooks read; with hooks set, say by a profiler, it goes through
``CompiledKernel[grid]``). Measured there in one run: a 40-argument launch
27 -> 14 us, a B=1 decode call (three launches) 132 -> 107 us; one launch of
a one-argument kernel still costs 8 to 12 us (the driver).

What Triton specialises a launch on, and so what keys a kept kernel:
  - the constexprs and launch options: the site's own, fixed when it is made;
  - each tensor's dtype and whether its address is 16-byte aligned (a call
    with an unaligned tensor takes Triton's own path, which knows better);
  - each scalar's value (ints specialise on ``== 1``, ``% 16 == 0`` and
    their width); every call site passes a fixed Python type per position;
  - the grid and the current CUDA device (a kernel is loaded per device).

The interpreter (the CPU CI) always takes Triton's own path.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
from triton import knobs
from triton.runtime.driver import driver

from . import config

# False: every launch takes Triton's own path (tests compare the two; debugging).
DIRECT = True

# Kept specialisations per site: a site sees one per (grid, scalars), and an eager
# prefill brings a new grid per prompt length.
_MAX_KEPT = 64


class KernelSite:
    """One kernel with fixed constexprs; ``site(grid, tensors, scalars)`` launches it.

    The kernel's parameters must be ``*tensors, *scalars`` followed by the
    constexprs (every one given in ``constexprs``), which may also hold
    launch options (``num_warps``, ``num_stages``, ``maxnreg``).
    """

    __slots__ = ("kernel", "constexprs", "_tail", "_kept")

    def __init__(self, kernel, constexprs: dict):
        self.kernel = kernel
        self.constexprs = constexprs
        self._tail: Optional[tuple] = None  # constexpr values in parameter order, once known
        self._kept: dict = {}

    def __call__(self, grid: tuple, tensors: tuple, scalars: tuple) -> None:
        if config.KERNELS_INTERPRETED or not DIRECT:
            self.kernel[grid](*tensors, *scalars, **self.constexprs)
            return
        low_bits = 0
        for t in tensors:
            low_bits |= t.data_ptr()
        if low_bits & 15:
            self.kernel[grid](*tensors, *scalars, **self.constexprs)
            return
        device = _current_device()
        key = (grid, scalars, tuple([t.dtype for t in tensors]), device)
        kept = self._kept.get(key)
        if kept is None:
            self._keep(key, grid, self.kernel[grid](*tensors, *scalars, **self.constexprs), len(tensors) + len(scalars))
            return
        compiled, grid3 = kept
        runtime = knobs.runtime
        if _idle(runtime.launch_enter_hook) and _idle(runtime.launch_exit_hook):
            # What `compiled[grid3]` does, minus the launch metadata that only hooks read.
            compiled.run(grid3[0], grid3[1], grid3[2], current_stream(device), compiled.function,
                         compiled.packed_metadata, None, None, None, *tensors, *scalars, *self._tail)
        else:  # a profiler's hooks: Triton's runner builds their metadata
            compiled[grid3](*tensors, *scalars, *self._tail)

    def _keep(self, key: tuple, grid: tuple, compiled, n_runtime: int) -> None:
        if self._tail is None:
            self._tail = self._constexpr_tail(n_runtime)
        if self._tail is None or not hasattr(compiled, "packed_metadata"):
            return
        if len(self._kept) >= _MAX_KEPT:
            self._kept.clear()
        self._kept[key] = (compiled, tuple(grid) + (1,) * (3 - len(grid)))

    def _constexpr_tail(self, n_runtime: int) -> Optional[tuple]:
        """The constexpr values after the runtime arguments, in parameter order (given, else the default).

        None (Triton's own path every time) where the kernel's parameters cannot be read.
        """
        params = getattr(self.kernel, "params", None)
        if params is None or len(params) < n_runtime:
            return None
        tail = []
        for p in params[n_runtime:]:
            if p.name in self.constexprs:
                tail.append(self.constexprs[p.name])
            elif getattr(p, "has_default", False):
                tail.append(p.default)
            else:
                return None
        return tuple(tail)


class Launch(NamedTuple):
    """A launch prepared ahead of time and issued by calling it.

    A call with several kernels builds every launch (buffers, strides, arguments) first and then
    issues them back to back: host work between two launches is device idle time whenever the host
    is not ahead of the device. An eager mse decode step launches the query rotation (a few us of
    device time) and then the decode kernel, whose buffers and arguments took tens of us of Python
    in between. H200, `do_bench` event time of an eager B=1 x 4k 4bit_nc decode, two runs (us):
    67, 85 before, 29, 37 issued back to back (CUDA-graph replay 12.7 either way). The B=32 rows'
    event times did not move (their ~9 us over the graph replay is not host time).
    """

    site: KernelSite
    grid: tuple
    tensors: tuple
    scalars: tuple

    def __call__(self) -> None:
        self.site(self.grid, self.tensors, self.scalars)


def _idle(hook) -> bool:
    """True for no launch hook: None, or an empty `triton.knobs.HookChain` (Triton 3.6+ default)."""
    return hook is None or getattr(hook, "calls", None) == []


# Triton's query of the current stream, resolved once (`driver.active` is a lazy proxy).
_stream_of = None


def current_stream(device: int) -> int:
    """The handle of device ``device``'s current CUDA stream (what a launch goes to)."""
    global _stream_of
    if _stream_of is None:
        _stream_of = driver.active.get_current_stream
    return _stream_of(device)


# The current CUDA device: what `torch.cuda.current_device` returns once CUDA is initialised (a launch has
# CUDA tensors), without its initialisation check. CPU builds of torch lack it, and never launch directly.
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


@functools.lru_cache(maxsize=512)
def _site(kernel, constexpr_items: tuple) -> KernelSite:
    return KernelSite(kernel, dict(constexpr_items))


def kernel_site(kernel, constexprs: dict) -> KernelSite:
    """The process-wide `KernelSite` of ``kernel`` with these constexprs and options (hashable values).

    For launches whose constexprs are built per call; cached specs hold their sites instead.
    """
    return _site(kernel, tuple(constexprs.items()))
