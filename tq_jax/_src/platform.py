"""Where kernels run: the Triton lowering on a GPU, Pallas interpret mode elsewhere.

Every `pallas_call` in tq_jax goes through `pallas_kwargs`, so each one passes
`compiler_params=pltriton.CompilerParams(...)` explicitly (without it jax
0.10/0.11 lower to Mosaic GPU instead of Triton).

The automatic choice (``interpret=None`` on the public ops) is made by the
*lowering* platform, not by `jax.default_backend()`: `by_lowering_platform`
stages both variants with `lax.platform_dependent`, and lowering keeps only the
branch of the platform being compiled for. So ``jax.export(..., platforms=
["cuda"])`` on a CPU-only host embeds the Triton kernels (no interpreter
loops), and a CPU export embeds the interpreter. Exports name one platform
at a time: a multi-platform export (``platforms=["cpu", "cuda"]``) fails in
jax's lowering, which lowers every branch's `pallas_call` for every platform.
Exporting for CUDA also needs jax's opt-out for the (not version-stable)
Triton custom call: ``disabled_checks=[jax.export.DisabledSafetyCheck.
custom_call("__gpu$xla.gpu.triton")]``.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental.pallas import triton as pltriton

# Platforms whose tq_jax kernels lower through Triton; every other platform
# (cpu, and anything unknown) runs them in Pallas interpret mode.
_TRITON_PLATFORMS = ("cuda", "rocm")


def interpret_default() -> bool:
    """True when the *default backend* has no Triton lowering (eager helpers, tests).

    Only for code that runs outside a trace; traced code uses `by_lowering_platform`.
    """
    return jax.default_backend() not in ("gpu",) + _TRITON_PLATFORMS


def check_interpret(interpret) -> bool | None:
    """Validates the public ``interpret=`` keyword: None (automatic), True or False."""
    if interpret is not None and not isinstance(interpret, bool):
        raise TypeError(f"interpret: expected None (automatic), True or False, got {interpret!r}")
    return interpret


def by_lowering_platform(fn, *args, interpret: bool | None):
    """``fn(*args, interpret=...)``, with None resolved per lowering platform.

    Args:
      fn: traceable; takes `args` (pytrees of arrays, None allowed) and a
        keyword ``interpret: bool``.
      interpret: True/False forces the mode; None stages ``interpret=False``
        for cuda/rocm and ``interpret=True`` for every other platform (both
        are traced; only the lowering platform's branch is lowered).
    """
    if interpret is not None:
        return fn(*args, interpret=interpret)
    compiled = functools.partial(fn, interpret=False)
    interpreted = functools.partial(fn, interpret=True)
    # One callable for both GPU platforms: platform_dependent joins equal branches.
    return lax.platform_dependent(*args, default=interpreted, **{p: compiled for p in _TRITON_PLATFORMS})


def pallas_kwargs(*, interpret: bool | None, num_warps: int, num_stages: int = 1) -> dict:
    """Keyword arguments shared by every tq_jax `pallas_call`.

    Args:
      interpret: True/False (resolved by the caller, see `by_lowering_platform`);
        None falls back to `interpret_default()` (direct kernel calls in tests).
      num_warps: warps per program (power of two, 1..16).
      num_stages: software-pipelining stages of the Triton compiler.
    """
    if interpret is None:
        interpret = interpret_default()
    return dict(
        interpret=bool(interpret),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )
