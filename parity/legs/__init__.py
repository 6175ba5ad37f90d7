"""Legs: the implementations the parity suite drives (reference, torch, jax).

`load_leg(name)` never raises for a leg that cannot run here: it returns an
`Unavailable` holding the reason, and the runner reports every record of that
leg as ``unavailable`` (counted as skipped, never as passed).
"""

from __future__ import annotations

from .base import OPS, Leg, Unavailable, missing_ops

LEG_NAMES = ("reference", "torch", "jax")
# Self-test legs (parity.legs.fakes), accepted by --legs but never run by default.
SELF_TEST_LEGS = ("numpy",) + tuple(f"broken-{k}" for k in (
    "window-extend", "window-off-by-one", "gqa-modulo", "store-canary", "inf-output"))


def load_leg(name: str):
    """The leg called `name`, or `Unavailable` with the reason it cannot run."""
    if name == "reference":
        from .reference import ReferenceLeg

        return ReferenceLeg()
    if name == "torch":
        from .torch_leg import load

        return load()
    if name == "jax":
        from .jax_leg import load

        return load()
    if name in SELF_TEST_LEGS:
        from .fakes import BrokenLeg, NumpyLeg

        return NumpyLeg() if name == "numpy" else BrokenLeg(name.removeprefix("broken-"))
    raise ValueError(f"legs: unknown leg {name!r}; expected some of {', '.join(LEG_NAMES + SELF_TEST_LEGS)}")


__all__ = ["LEG_NAMES", "SELF_TEST_LEGS", "OPS", "Leg", "Unavailable", "load_leg", "missing_ops"]
