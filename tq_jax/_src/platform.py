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
import re

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


def pallas_kwargs(*, interpret: bool | None, name: str, num_warps: int, num_stages: int = 1,
                  max_registers: int | None = None) -> dict:
    """Keyword arguments shared by every tq_jax `pallas_call`.

    Args:
      interpret: True/False (resolved by the caller, see `by_lowering_platform`);
        None falls back to `interpret_default()` (direct kernel calls in tests).
      name: the kernel's name.
      num_warps: warps per program (power of two, 1..16).
      num_stages: software-pipelining stages of the Triton compiler.
      max_registers: registers per thread the compiled kernel may use (Triton's
        ``maxnreg``; None: ptxas decides). Ignored in interpret mode and where
        the jax version has no hook for it (`REGISTER_CAP_HOOKED`).
    """
    if interpret is None:
        interpret = interpret_default()
    if max_registers is not None and not interpret:
        name = f"{name}{_CAP_SUFFIX}{int(max_registers)}"
    return dict(
        name=name,
        interpret=bool(interpret),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )


# Register caps. `pltriton.CompilerParams` has no ``maxnreg`` (jax 0.10-0.12), but Triton reads
# the module attribute ``ttg.maxnreg`` when it lowers to LLVM (it is what `triton.compile`'s own
# ``maxnreg`` option sets), and the Pallas lowering hands the module it builds to that pipeline
# (XLA's or jaxlib's). So a kernel asks for a cap through its name (``<name>_maxnreg<N>``, the
# only per-call fact that reaches `lower_jaxpr_to_triton_module`), and the wrapper below puts the
# attribute on the lowered module. Without the private function the caps are dropped: kernels stay
# correct and ptxas picks the register count.
_CAP_SUFFIX = "_maxnreg"
_CAP_NAME = re.compile(re.escape(_CAP_SUFFIX) + r"(\d+)$")


def _install_register_cap_hook() -> bool:
    try:
        from jax._src.lib.mlir import ir
        from jax._src.pallas.triton import lowering as triton_lowering
    except ImportError:
        return False
    original = getattr(triton_lowering, "lower_jaxpr_to_triton_module", None)
    if original is None:
        return False
    if getattr(original, "_tq_register_cap", False):
        return True

    @functools.wraps(original)
    def lower_with_register_cap(jaxpr, *args, **kwargs):
        result = original(jaxpr, *args, **kwargs)
        match = _CAP_NAME.search(getattr(jaxpr.debug_info, "func_name", "") or "")
        if match is not None:
            op = result.module.operation
            with op.context:
                op.attributes["ttg.maxnreg"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32),
                                                                   int(match.group(1)))
        return result

    lower_with_register_cap._tq_register_cap = True
    triton_lowering.lower_jaxpr_to_triton_module = lower_with_register_cap
    return True


REGISTER_CAP_HOOKED = _install_register_cap_hook()
