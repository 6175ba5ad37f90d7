"""Dispatch as data: the attention paths and when each may run (DESIGN.md section 4).

Both frameworks select paths through this one table, from static shapes only
(no device reads), so a path choice never depends on which framework runs it.
Every path must compute the same function on every case it is eligible for;
tests force each eligible path with ``path=``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .presets import PresetLike, get_preset


@dataclass(frozen=True)
class DispatchProblem:
    """The static facts a path choice may depend on."""

    num_tokens: int
    num_seqs: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    preset: PresetLike
    sliding_window: Optional[int] = None

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads


@dataclass(frozen=True)
class PathRule:
    """One attention path: its name, a summary and an eligibility rule.

    ``ineligible(problem)`` returns None when the path may run, else the reason.
    """

    name: str
    summary: str
    ineligible: Callable[[DispatchProblem], Optional[str]]


def _always(_: DispatchProblem) -> Optional[str]:
    return None


PATHS: dict[str, PathRule] = {
    rule.name: rule
    for rule in (
        PathRule(
            "decode",
            "split-KV over the context: programs per (sequence, kv head, split) serving the "
            "whole GQA group, correct for any q_len (a sequence with several queries gets more "
            "query tiles); partials merged by log-sum-exp",
            _always,
        ),
        PathRule(
            "extend",
            "query-row tiles x key tiles over the paged cache with causal and window masks "
            "(prefill, chunked prefill, prefix-cached continuation, mixed batches)",
            _always,
        ),
    )
}
PATH_NAMES: tuple[str, ...] = tuple(PATHS)


def eligible_paths(problem: DispatchProblem) -> tuple[str, ...]:
    """Names of every path that may run `problem`, in table order."""
    return tuple(name for name, rule in PATHS.items() if rule.ineligible(problem) is None)


def select_path(problem: DispatchProblem, path: str = "auto") -> str:
    """The path to run: `path` if forced (and eligible), else the automatic choice.

    Automatic: ``decode`` when ``num_tokens <= num_seqs`` (at most one query per
    sequence on average: a decode or decode-dominated batch), else ``extend``.

    Raises:
      ValueError: unknown path name.
      NotImplementedError: a forced path that is not eligible, with the reason.
    """
    get_preset(problem.preset)
    if path == "auto":
        choice = "decode" if problem.num_tokens <= problem.num_seqs else "extend"
        if PATHS[choice].ineligible(problem) is None:
            return choice
        for name, rule in PATHS.items():
            if rule.ineligible(problem) is None:
                return name
        raise NotImplementedError(f"no attention path supports {problem}")
    if path not in PATHS:
        raise ValueError(f"path: expected 'auto' or one of {PATH_NAMES}, got {path!r}")
    reason = PATHS[path].ineligible(problem)
    if reason is not None:
        raise NotImplementedError(f"path {path!r} cannot run this problem: {reason}")
    return path
