"""Orthogonal rotations applied to unit keys before scalar quantization.

``y = Pi @ u``. Kinds:

* ``"hadamard"`` (default, vLLM 0.33): Sylvester Hadamard ``H / sqrt(D)``,
  symmetric, identical for every layer.
* ``"randomized_hadamard"`` (paper-faithful): ``H @ diag(signs) / sqrt(D)``.
  ``signs`` are drawn as ``1 - 2 * rng.integers(0, 2, size=D)`` with
  ``rng = numpy.random.Generator(numpy.random.PCG64(seed))``; ``seed=None``
  means `DEFAULT_ROTATION_SEED`. The matrix is data the kernels receive.

Matrices are float32 (what the kernels multiply with); the float64 reference
uses the same float32 numbers widened.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

ROTATION_KINDS = ("hadamard", "randomized_hadamard")
ROTATION_HEAD_DIMS = (64, 128, 256, 512)
DEFAULT_ROTATION_SEED = 0x7E60_0A17


def _sylvester(d: int) -> np.ndarray:
    i = np.arange(d)
    # H[i, j] = (-1) ** popcount(i & j) is the Sylvester construction.
    parity = np.bitwise_count((i[:, None] & i[None, :]).astype(np.uint32)) & 1
    return np.where(parity == 1, -1.0, 1.0)


def rotation_signs(head_dim: int, seed: int | None = None) -> np.ndarray:
    """The +-1 signs of the randomized Hadamard rotation (float32 ``[D]``)."""
    rng = np.random.Generator(np.random.PCG64(DEFAULT_ROTATION_SEED if seed is None else seed))
    return (1 - 2 * rng.integers(0, 2, size=head_dim)).astype(np.float32)


@lru_cache(maxsize=None)
def _rotation(head_dim: int, kind: str, seed: int | None) -> np.ndarray:
    h = _sylvester(head_dim) / np.sqrt(head_dim)
    if kind == "randomized_hadamard":
        h = h * rotation_signs(head_dim, seed).astype(np.float64)[None, :]
    out = h.astype(np.float32)
    out.setflags(write=False)
    return out


def rotation(head_dim: int, kind: str = "hadamard", seed: int | None = None) -> np.ndarray:
    """The rotation matrix ``Pi`` (float32 ``[D, D]``, read-only, cached).

    Raises:
      ValueError: head_dim not a power of two in 64..512, unknown kind, or a
        seed given for the (seedless) ``"hadamard"`` kind.
    """
    if kind not in ROTATION_KINDS:
        raise ValueError(f"kind: expected one of {ROTATION_KINDS}, got {kind!r}")
    if head_dim not in ROTATION_HEAD_DIMS:
        raise ValueError(
            f"head_dim: rotations need a power of two in {ROTATION_HEAD_DIMS}, got {head_dim!r}"
        )
    if kind == "hadamard" and seed is not None:
        raise ValueError("seed: the 'hadamard' rotation has no randomness; pass seed=None")
    return _rotation(int(head_dim), kind, seed)
