"""Lloyd-Max codebooks for rotated key coordinates, distributed ~ N(0, 1/D).

Flavor ``"vllm"`` reproduces vLLM 0.33's construction bit for bit: a Python
float64 loop with trapezoid integrals, then a float32 cast. Its summation order
and `math.exp` are part of the contract, so it is deliberately a scalar loop.
Flavor ``"exact"`` uses closed-form Gaussian cell integrals iterated to
convergence. Midpoints are computed in float32 from the float32 centroids,
because that is what the kernels compare against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

CODEBOOK_FLAVORS = ("vllm", "exact")
CODEBOOK_BITS = (1, 2, 3, 4, 5, 6, 7, 8)


@dataclass(frozen=True, eq=False)
class Codebook:
    """Sorted scalar codebook for head_dim ``head_dim`` and ``bits`` bits.

    Attributes:
      centroids: float32 ``[2**bits]``, ascending, symmetric about 0.
      midpoints: float32 ``[2**bits - 1]``; ``midpoints[j] = (c[j] + c[j+1]) / 2``
        in float32. A coordinate ``y`` gets code ``sum(y >= midpoints)``.
    """

    head_dim: int
    bits: int
    flavor: str
    centroids: np.ndarray = field(repr=False)
    midpoints: np.ndarray = field(repr=False)


def _gaussian_pdf(x: float, sigma2: float) -> float:
    return (1.0 / math.sqrt(2 * math.pi * sigma2)) * math.exp(-x * x / (2 * sigma2))


def _trapezoid(f, a: float, b: float, n: int = 200) -> float:
    # Sequential accumulation in this exact order is what vLLM does.
    h = (b - a) / n
    total = 0.5 * (f(a) + f(b))
    for i in range(1, n):
        total += f(a + i * h)
    return total * h


def _lloyd_max_vllm(head_dim: int, bits: int) -> list[float]:
    levels = 1 << bits
    sigma2 = 1.0 / head_dim
    sigma = math.sqrt(sigma2)

    def pdf(x: float) -> float:
        return _gaussian_pdf(x, sigma2)

    def xpdf(x: float) -> float:
        return x * pdf(x)

    lo, hi = -3.5 * sigma, 3.5 * sigma
    centroids = [lo + (hi - lo) * (i + 0.5) / levels for i in range(levels)]
    for _ in range(200):
        mids = [(centroids[i] + centroids[i + 1]) / 2.0 for i in range(levels - 1)]
        edges = [lo * 3] + mids + [hi * 3]
        updated = []
        for i in range(levels):
            a, b = edges[i], edges[i + 1]
            num = _trapezoid(xpdf, a, b)
            den = _trapezoid(pdf, a, b)
            updated.append(num / den if den > 1e-15 else centroids[i])
        if max(abs(updated[i] - centroids[i]) for i in range(levels)) < 1e-10:
            break  # keep the previous centroids, as vLLM does
        centroids = updated
    return centroids


def _lloyd_max_exact(head_dim: int, bits: int) -> list[float]:
    levels = 1 << bits
    sigma = 1.0 / math.sqrt(head_dim)
    c = [sigma * (-3.5 + 7.0 * (i + 0.5) / levels) for i in range(levels)]
    for _ in range(100_000):
        edges = [-math.inf] + [(c[i] + c[i + 1]) / 2 for i in range(levels - 1)] + [math.inf]
        new = []
        for i in range(levels):
            a, b = edges[i] / sigma, edges[i + 1] / sigma
            mass = 0.5 * (math.erf(b / math.sqrt(2)) - math.erf(a / math.sqrt(2)))
            phi_a = 0.0 if math.isinf(a) else math.exp(-a * a / 2) / math.sqrt(2 * math.pi)
            phi_b = 0.0 if math.isinf(b) else math.exp(-b * b / 2) / math.sqrt(2 * math.pi)
            new.append(sigma * (phi_a - phi_b) / mass if mass > 0 else c[i])
        if max(abs(x - y) for x, y in zip(new, c)) < 1e-15 * sigma:
            return new
        c = new
    return c


@lru_cache(maxsize=None)
def _codebook(head_dim: int, bits: int, flavor: str) -> Codebook:
    solve = _lloyd_max_vllm if flavor == "vllm" else _lloyd_max_exact
    centroids = np.asarray(solve(head_dim, bits), dtype=np.float64).astype(np.float32)
    midpoints = (centroids[:-1] + centroids[1:]) / np.float32(2)
    centroids.setflags(write=False)
    midpoints.setflags(write=False)
    return Codebook(head_dim, bits, flavor, centroids, midpoints.astype(np.float32))


def codebook(head_dim: int, bits: int, flavor: str = "vllm") -> Codebook:
    """The Lloyd-Max codebook for N(0, 1/head_dim) with ``2**bits`` levels (cached).

    Raises:
      ValueError: head_dim < 1, bits outside 1..8, or an unknown flavor.
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, (int, np.integer)) or head_dim < 1:
        raise ValueError(f"head_dim: expected a positive int, got {head_dim!r}")
    if bits not in CODEBOOK_BITS:
        raise ValueError(f"bits: expected one of {CODEBOOK_BITS}, got {bits!r}")
    if flavor not in CODEBOOK_FLAVORS:
        raise ValueError(f"flavor: expected one of {CODEBOOK_FLAVORS}, got {flavor!r}")
    return _codebook(int(head_dim), int(bits), flavor)
