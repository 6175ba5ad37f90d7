"""Where kernels run: the Triton lowering on a GPU, Pallas interpret mode on CPU.

Every `pallas_call` in tq_jax goes through `pallas_kwargs`, so each one passes
`compiler_params=pltriton.CompilerParams(...)` explicitly (without it jax
0.10/0.11 lower to Mosaic GPU instead of Triton) and picks interpret mode
automatically when the default backend is the CPU.
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import triton as pltriton


def interpret_default() -> bool:
    """True when kernels must run in Pallas interpret mode (no GPU backend)."""
    return jax.default_backend() == "cpu"


def pallas_kwargs(*, interpret: bool | None, num_warps: int, num_stages: int = 1) -> dict:
    """Keyword arguments shared by every tq_jax `pallas_call`.

    Args:
      interpret: None picks `interpret_default()`; True/False forces it (tests
        force False to lower kernels to Triton IR on a CPU-only jaxlib).
      num_warps: warps per program (power of two, 1..16).
      num_stages: software-pipelining stages of the Triton compiler.
    """
    if interpret is None:
        interpret = interpret_default()
    return dict(
        interpret=bool(interpret),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
    )
