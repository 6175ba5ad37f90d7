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
    # Static facts the ``dequant`` path needs: the query dtype name ("bfloat16",
    # "float16", "float32") and the block table's width. None = unknown, and
    # then ``dequant`` is not eligible.
    query_dtype: Optional[str] = None
    max_blocks: Optional[int] = None

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


# The ``dequant`` path's workspace holds every page the block table can name
# (static shapes, so a CUDA graph can capture it); above this size it is not
# eligible.
DEQUANT_WORKSPACE_BYTES = 1 << 30


def dequant_workspace_bytes(problem: DispatchProblem) -> int:
    """Bytes of the ``dequant`` path's 16-bit K/V workspace: ``[B * max_blocks, P, Hkv, 4 * D]``."""
    return (problem.num_seqs * (problem.max_blocks or 0) * problem.block_size * problem.num_kv_heads
            * 4 * problem.head_dim)


def _dequant_ineligible(problem: DispatchProblem) -> Optional[str]:
    if problem.query_dtype not in ("bfloat16", "float16"):
        return (f"the workspace holds 16-bit K/V, so the query must be bfloat16 or float16 "
                f"(got {problem.query_dtype or 'an unknown dtype'})")
    if problem.max_blocks is None:
        return "the block table width is unknown"
    need = dequant_workspace_bytes(problem)
    if need > DEQUANT_WORKSPACE_BYTES:
        return f"the workspace would take {need} bytes (limit {DEQUANT_WORKSPACE_BYTES})"
    return None


def decode_tile_rows(group_size: int) -> int:
    """Query rows of one ``decode`` tile: the GQA group padded to a power of two >= 16.

    16 is the smallest M of a tensor-core dot. The spare rows take the
    sequence's next query tokens, so each K/V byte a tile reads serves
    ``decode_tile_tokens(group_size)`` tokens of the whole group at once.
    """
    return max(16, 1 << (group_size - 1).bit_length())


def decode_tile_tokens(group_size: int) -> int:
    """Query tokens of one sequence that share a ``decode`` tile (16 at G = 1, 4 at G = 4, 1 at G >= 16)."""
    return decode_tile_rows(group_size) // group_size


# `auto` takes ``dequant`` for batches with at least this many query rows per
# sequence on average (prefills, chunked prefills, mixed batches), where the
# extend tiles would dequantise each key once per row tile.
DEQUANT_MIN_TOKENS_PER_SEQ = 16


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
        PathRule(
            "dequant",
            "dequantise every page the batch can see into a 16-bit K/V workspace (one pass), then "
            "the extend tiles over it; for prefill-heavy batches",
            _dequant_ineligible,
        ),
    )
}
PATH_NAMES: tuple[str, ...] = tuple(PATHS)


def dtype_name(x) -> str:
    """``"bfloat16"``, ``"float16"``, ``"float32"``...: an array's dtype name (numpy, torch or jax)."""
    return str(x.dtype).removeprefix("torch.")


def problem_for(query, kv_cache, block_table, *, preset: PresetLike,
                sliding_window: Optional[int] = None) -> DispatchProblem:
    """The `DispatchProblem` of a `paged_attention` call, from its arrays' static shapes and dtypes.

    ``query [T, Hq, D]``, ``kv_cache [N, P, Hkv, slot_bytes]``, ``block_table [B, max_blocks]``:
    numpy, torch or jax arrays (only shapes and the query dtype are read; no device sync).
    """
    t, hq, d = (int(s) for s in query.shape)
    return DispatchProblem(
        num_tokens=t, num_seqs=int(block_table.shape[0]), num_q_heads=hq, num_kv_heads=int(kv_cache.shape[2]),
        head_dim=d, block_size=int(kv_cache.shape[1]), preset=preset, sliding_window=sliding_window,
        query_dtype=dtype_name(query), max_blocks=int(block_table.shape[1]))


def eligible_paths(problem: DispatchProblem) -> tuple[str, ...]:
    """Names of every path that may run `problem`, in table order."""
    return tuple(name for name, rule in PATHS.items() if rule.ineligible(problem) is None)


def select_path(problem: DispatchProblem, path: str = "auto") -> str:
    """The path to run: `path` if forced (and eligible), else the automatic choice.

    Automatic: ``decode`` when ``num_tokens <= num_seqs * decode_tile_tokens(G)``
    (the average sequence's queries fit one decode tile: decode steps and
    multi-token decode such as speculative verification, where each split
    program reads its keys once for every query of the tile); else ``dequant``
    for a quantised preset with at least `DEQUANT_MIN_TOKENS_PER_SEQ` rows per
    sequence when it is eligible; else ``extend``.

    Raises:
      TypeError: `path` is not a str.
      ValueError: unknown path name.
      NotImplementedError: a forced path that is not eligible, with the reason.
    """
    if not isinstance(path, str):
        raise TypeError(f"path: expected a str ('auto' or a path name), got {type(path).__name__}")
    get_preset(problem.preset)
    if path == "auto":
        if problem.num_tokens <= problem.num_seqs * decode_tile_tokens(problem.group_size):
            choice = "decode"
        elif (get_preset(problem.preset).key_format != "raw"
              and problem.num_tokens >= DEQUANT_MIN_TOKENS_PER_SEQ * problem.num_seqs
              and PATHS["dequant"].ineligible(problem) is None):
            choice = "dequant"
        else:
            choice = "extend"
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
