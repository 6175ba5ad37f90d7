"""A seeded fuzzer: random valid problems, and a shrinker that turns a failure into a one-line repro.

`fuzz_cases(n, seed, mode)` draws `n` `AttentionCase`s (group ``fuzz``) from a generator seeded by
``(seed, index)``: preset, head dim (any the preset takes), page size (1 to 48, not only powers of
two), GQA ratio (1 to 7), kv heads, window, soft cap, sinks, query dtype and a ragged batch (1 to 4
sequences mixing decode, prefill, continuation, q_len 0 and seq_len 0 requests), sometimes padding
rows past ``query_start_loc[B]`` and a repeated block table (later sequences sharing the first one's
pages). Pages are always permuted (`parity.catalog.problem.paged_batch`).

A fuzz case is not in any catalog, so its repro names the case itself: `case_spec` writes the
fields that differ from the defaults as one JSON object and ``python -m parity --case '<json>'``
reads it back (`parse_case_spec`); the arrays follow from the case id and the seed as for every
case. `shrink` simplifies a failing case one field at a time (fewer sequences, shorter ones, no
window / cap / sinks / padding / sharing, fewer heads, a smaller head dim, a common page size) and
keeps each step that still fails.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Optional

import tq_spec

from .cases import AttentionCase
from .sweeps import rng_for

FUZZ_CHECKS = ("store", "attention", "paths", "cross")
_QUICK = dict(max_len=40, max_seqs=4, head_dims=(32, 40, 64, 72, 96, 128), pages=(1, 2, 3, 4, 5, 8, 16, 48))
_FULL = dict(max_len=3000, max_seqs=6, head_dims=(32, 64, 80, 96, 128, 192, 256, 512),
             pages=(1, 3, 8, 16, 32, 48, 128))


def _head_dim(rng, preset: str, dims) -> int:
    ok = [d for d in dims if _valid(preset, d)]
    return int(rng.choice(ok))


def _valid(preset: str, d: int) -> bool:
    try:
        tq_spec.layout(preset, d)
    except ValueError:
        return False
    return True


def _seq(rng, max_len: int) -> tuple[int, int]:
    kind = rng.choice(["decode", "prefill", "continuation", "q0", "empty"], p=[0.35, 0.2, 0.3, 0.1, 0.05])
    if kind == "empty":
        return (0, 0)
    s = int(rng.integers(1, max_len + 1))
    if kind == "decode":
        return (s, 1)
    if kind == "prefill":
        return (s, s)
    if kind == "q0":
        return (s, 0)
    return (s, int(rng.integers(1, s + 1)))


def draw_case(seed: int, index: int, mode: str = "quick") -> AttentionCase:
    """One random valid case, deterministic in ``(seed, index, mode)``."""
    cfg = _QUICK if mode == "quick" else _FULL
    rng = rng_for("fuzz", seed, index, mode)
    preset = str(rng.choice(tq_spec.PRESET_NAMES))
    d = _head_dim(rng, preset, cfg["head_dims"])
    hkv = int(rng.choice([1, 2, 3]))
    hq = hkv * int(rng.choice([1, 2, 3, 4, 5, 7]))
    seqs = tuple(_seq(rng, cfg["max_len"]) for _ in range(int(rng.integers(1, cfg["max_seqs"] + 1))))
    if all(q == 0 for _, q in seqs):
        seqs = seqs + ((int(rng.integers(1, cfg["max_len"] + 1)), 1),)
    window = None if rng.random() < 0.5 else int(rng.integers(1, cfg["max_len"] + 1))
    cap = None if rng.random() < 0.6 else float(rng.choice([1.0, 2.5, 5.0, 20.0, 50.0]))
    return AttentionCase(
        group="fuzz", preset=preset, head_dim=d, num_q_heads=hq, num_kv_heads=hkv,
        block_size=int(rng.choice(cfg["pages"])), seqs=seqs, sliding_window=window, logits_soft_cap=cap,
        sinks=bool(rng.random() < 0.4), dtype=str(rng.choice(["bfloat16", "float16", "float32"])),
        data="sharp" if cap is not None else "normal",
        pad_rows=int(rng.choice([0, 0, 0, 1, 3])),
        shared_pages=int(rng.choice([0, 0, 1, 2])) if len(seqs) > 1 else 0,
        slot_dtype=str(rng.choice(["int64", "int32"])),
        checks=FUZZ_CHECKS)


def fuzz_cases(n: int, seed: int, mode: str = "quick") -> list[AttentionCase]:
    """`n` fuzz cases (ids unique: a repeated draw is skipped, so there may be fewer)."""
    seen, out = set(), []
    for i in range(n):
        c = draw_case(seed, i, mode)
        if c.id not in seen:
            seen.add(c.id)
            out.append(c)
    return out


# ---------------------------------------------------------------------------- case specs

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(AttentionCase)
             if f.default is not dataclasses.MISSING}


def case_spec(case: AttentionCase) -> str:
    """One-line JSON of the fields of `case` that are not defaults (what ``--case`` reads)."""
    out = {}
    for f in dataclasses.fields(AttentionCase):
        v = getattr(case, f.name)
        if f.name in ("tags", "note", "known"):
            continue
        if f.name in _DEFAULTS and v == _DEFAULTS[f.name]:
            continue
        out[f.name] = [list(s) for s in v] if f.name == "seqs" else (list(v) if isinstance(v, tuple) else v)
    return json.dumps(out, separators=(",", ":"))


def parse_case_spec(text: str) -> AttentionCase:
    """The `AttentionCase` of a `case_spec` string (ValueError naming what is wrong)."""
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--case: expected a JSON object of AttentionCase fields, got {text!r} ({e})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"--case: expected a JSON object, got {type(fields).__name__}")
    names = {f.name for f in dataclasses.fields(AttentionCase)}
    unknown = set(fields) - names
    if unknown:
        raise ValueError(f"--case: unknown fields {sorted(unknown)}; expected some of {sorted(names)}")
    fields.setdefault("group", "case")
    if "seqs" in fields:
        fields["seqs"] = tuple(tuple(int(x) for x in s) for s in fields["seqs"])
    for name in ("checks", "chunks", "decode_splits"):
        if name in fields:
            fields[name] = tuple(fields[name])
    try:
        return AttentionCase(**fields)
    except TypeError as e:
        raise ValueError(f"--case: {e}") from None


# ---------------------------------------------------------------------------- shrinking


def _candidates(c: AttentionCase):
    """Simpler variants of `c`, most aggressive first."""
    rep = dataclasses.replace
    if len(c.seqs) > 1:
        for i in range(len(c.seqs)):
            rest = c.seqs[:i] + c.seqs[i + 1:]
            if any(q for _, q in rest):
                yield rep(c, seqs=rest, shared_pages=c.shared_pages if len(rest) > 1 else 0)
    for name, simple in (("pad_rows", 0), ("shared_pages", 0), ("sinks", False), ("logits_soft_cap", None),
                         ("sliding_window", None), ("slot_dtype", "int64"), ("dtype", "bfloat16")):
        if getattr(c, name) != simple:
            extra = {"data": "normal"} if name == "logits_soft_cap" else {}
            yield rep(c, **{name: simple}, **extra)
    for i, (s, q) in enumerate(c.seqs):
        for ns, nq in ((s // 2, min(q, s // 2)), (s, min(q, 1)), (max(q, 1), q), (s - 1, min(q, s - 1))):
            if (ns, nq) != (s, q) and 0 <= nq <= ns and ns >= 0:
                seqs = c.seqs[:i] + ((ns, nq),) + c.seqs[i + 1:]
                if any(qq for _, qq in seqs):
                    yield rep(c, seqs=seqs)
    if c.num_q_heads != c.num_kv_heads:
        yield rep(c, num_q_heads=c.num_kv_heads)
    if c.num_kv_heads > 1:
        g = c.num_q_heads // c.num_kv_heads
        yield rep(c, num_kv_heads=1, num_q_heads=g)
    for d in (64, 32):
        if d < c.head_dim and _valid(c.preset, d):
            yield rep(c, head_dim=d)
            break
    for p in (16, 8, 4):
        if p != c.block_size:
            yield rep(c, block_size=p)


def shrink(case: AttentionCase, fails: Callable[[AttentionCase], bool], *, budget: int = 40,
           log: Optional[Callable[[str], None]] = None) -> tuple[AttentionCase, int]:
    """The simplest variant of `case` that still `fails` (greedy; at most `budget` trial runs).

    Returns ``(case, runs)``. `fails(case)` must be True for the input case.
    """
    runs = 0
    current = case
    improved = True
    while improved and runs < budget:
        improved = False
        for cand in _candidates(current):
            if runs >= budget:
                break
            try:
                cand = dataclasses.replace(cand)  # re-validates the fields
            except ValueError:
                continue
            runs += 1
            if fails(cand):
                if log is not None:
                    log(f"shrink: still fails: {cand.id}")
                current = cand
                improved = True
                break
    return current, runs
