"""Declarative sweeps: a family of cases as fixed fields plus axes.

A `Sweep` expands to the cartesian product of its axes (optionally filtered
by ``where``), then either keeps every combination or draws ``sample`` of
them with a generator seeded by ``(seed, group)``. ``derive`` may compute
fields from the others (e.g. concrete sequence lengths for a batch mix),
with its own generator seeded by the combination, so the same seed always
yields the same cases with the same ids.

An axis key is a field name, or a tuple of field names whose values are
tuples (zipped fields that vary together).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from .cases import AttentionCase, Case

MODES = ("quick", "full")


def stable_seed(*parts) -> int:
    """A 63-bit integer from `parts`, identical across runs and platforms."""
    h = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1


def rng_for(*parts) -> np.random.Generator:
    """A numpy generator seeded by `stable_seed(*parts)`."""
    return np.random.Generator(np.random.PCG64(stable_seed(*parts)))


@dataclass(frozen=True)
class Sweep:
    """A family of cases.

    Attributes:
      group: the case group (first part of every id).
      fixed: fields shared by every case.
      axes: field (or tuple of fields) -> values; expanded as a product.
      sample: None keeps every combination; n draws n of them by seed.
      where: keeps a combination (a dict of fields) when it returns True.
      derive: ``(fields, rng) -> fields`` computes dependent fields.
      modes: the catalog modes (quick/full) the sweep belongs to.
      make: the case type (default `AttentionCase`).
    """

    group: str
    fixed: Mapping[str, Any] = field(default_factory=dict)
    axes: Mapping[Any, Sequence[Any]] = field(default_factory=dict)
    sample: Optional[int] = None
    where: Optional[Callable[[dict], bool]] = None
    derive: Optional[Callable[[dict, np.random.Generator], dict]] = None
    modes: tuple[str, ...] = MODES
    make: Callable[..., Case] = AttentionCase

    def combinations(self) -> list[dict]:
        """Every combination of the axes (before sampling), filtered by ``where``."""
        keys = list(self.axes)
        out = []
        for values in itertools.product(*(self.axes[k] for k in keys)):
            fields = dict(self.fixed)
            for k, v in zip(keys, values):
                if isinstance(k, tuple):
                    if len(k) != len(v):
                        raise ValueError(f"axes: {k} needs tuples of {len(k)} values, got {v!r}")
                    fields.update(zip(k, v))
                else:
                    fields[k] = v
            if self.where is None or self.where(fields):
                out.append(fields)
        return out

    def expand(self, seed: int) -> list[Case]:
        """The cases of this sweep for `seed` (deterministic)."""
        combos = self.combinations()
        if self.sample is not None and self.sample < len(combos):
            pick = rng_for("sweep", seed, self.group).choice(len(combos), self.sample, replace=False)
            combos = [combos[i] for i in sorted(pick)]
        cases = []
        for fields in combos:
            if self.derive is not None:
                fields = self.derive(dict(fields), rng_for("derive", seed, self.group, _combo_key(fields)))
            cases.append(self.make(group=self.group, **fields))
        return cases


def _combo_key(fields: dict) -> tuple:
    """Order-independent, hash-seed-independent identity of a combination.

    Tags are sets (whose repr order varies between runs) and never influence
    derived fields, so they are left out.
    """
    return tuple((k, repr(fields[k])) for k in sorted(fields) if k != "tags")


def expand_all(sweeps: Sequence[Sweep], mode: str, seed: int) -> list[Case]:
    """Expands the sweeps of `mode`, dropping duplicate ids (first one wins)."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    seen: dict[str, Case] = {}
    for sweep in sweeps:
        if mode not in sweep.modes:
            continue
        for case in sweep.expand(seed):
            seen.setdefault(case.id, case)
    return list(seen.values())
