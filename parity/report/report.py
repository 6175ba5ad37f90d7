"""Summaries and reports: the console table, failures with repro lines, JSON, Markdown.

The reports must survive any result, including the failures they exist to show:
an error of ``inf`` or ``nan`` is written to ``parity.json`` as the *string*
``"inf"``, ``"-inf"`` or ``"nan"`` (strict JSON has no such numbers, and ``null``
would hide which one it was), and both files are written to a temporary file
and renamed, so an interrupted or crashing run never leaves a truncated report.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections import defaultdict

from .records import FAILED, PASSED, SKIPPED, UNAVAILABLE, XFAILED, final_line, tally


# What each check name (the ``op`` column) compares; the Markdown report explains them.
OP_TEXT = {
    "store": "the leg's store_kv cache bytes vs the float64 reference's bytes (codes may differ only "
             "next to a quantization boundary; fp16/fp8 fields within 1 ulp)",
    "attention": "the leg's paged_attention on the reference's cache bytes vs the float64 reference on the "
                 "same bytes, once per path (auto and each eligible forced path)",
    "paths": "every attention path of one leg agrees with every other path of that leg",
    "cross-store": "torch vs jax cache bytes directly (leg `torch|jax`)",
    "cross": "torch vs jax attention outputs directly (leg `torch|jax`)",
    "interchange": "a cache written by one leg and read by another (leg `writer->reader`) vs the reference "
                   "on those bytes",
    "e2e": "the leg's store then attention vs dense float64 attention on the raw K/V, within the preset's "
           "expected distortion",
    "chunking": "the same tokens stored and attended in chunks (path `chunk=N`) equal one prefill",
    "model": "several layers in model order (mixed presets, windows, head dims), each vs the reference",
    "case": "the whole case: a skip (e.g. a GPU-only case on CPU) or a harness error",
    "errors": "a bad input (parity/catalog/bad_inputs.py) given to each kernel leg: with validate=True "
              "(path `validated:*`) it raises the reference's exception class naming the same argument; with "
              "validate=False (`unvalidated:<path>`) it does not crash (it runs in a child process), writes "
              "nothing outside the cache or its output (canary guards) and the untouched sequences' rows "
              "match the reference; `torch|jax` records say the two legs agree",
    "determinism": "the same inputs twice through the same leg give identical bytes (store) and identical "
                   "outputs (every path)",
    "cuda-graph": "the torch decode path captured in a CUDA graph and replayed with changed seq_lens equals "
                  "the eager call on the same inputs, and the reference (GPU only)",
}

# Display order: the comparisons in the order a case runs them, presets as tq_spec lists them.
OP_ORDER = ("store", "attention", "paths", "cross-store", "cross", "interchange", "e2e", "chunking", "model",
            "determinism", "cuda-graph", "errors", "case")


def _sort_key(key):
    from tq_spec import PRESET_NAMES

    op, preset, path = key
    op_i = OP_ORDER.index(op) if op in OP_ORDER else len(OP_ORDER)
    pr_i = PRESET_NAMES.index(preset) if preset in PRESET_NAMES else len(PRESET_NAMES)
    path_i = (0 if path == "auto" else 1, int(path[6:]) if path.startswith("chunk=") else 0, path)
    return (op_i, op, pr_i, preset, path_i)


def summary_rows(records) -> list[tuple]:
    """``(op, preset, path, passed, failed, skipped)`` grouped, in display order; with a fourth count,
    ``xfailed`` (known failures), when any record is one."""
    groups = defaultdict(lambda: [0, 0, 0, 0])
    for r in records:
        g = groups[(r.op, r.preset, r.path)]
        g[(PASSED, FAILED, SKIPPED, XFAILED).index(r.counted_as)] += 1
    width = 4 if any(r.status == XFAILED for r in records) else 3
    return [(op, preset, path, *groups[(op, preset, path)][:width])
            for op, preset, path in sorted(groups, key=_sort_key)]


def _headers(rows) -> tuple:
    base = ("op", "preset", "path", "passed", "failed", "skipped")
    return base + ("xfailed",) if rows and len(rows[0]) == 7 else base


def leg_seconds(records) -> list[tuple[str, float]]:
    """Wall time spent per leg (pairs under their pair name), largest first."""
    t = defaultdict(float)
    for r in records:
        t[r.leg] += r.seconds
    return sorted(t.items(), key=lambda kv: -kv[1])


def format_table(headers, rows) -> str:
    cols = list(zip(headers, *rows)) if rows else [(h,) for h in headers]
    widths = [max(len(str(x)) for x in col) for col in cols]
    numeric = [all(isinstance(x, (int, float)) for x in col[1:]) and len(col) > 1 for col in cols]

    def fmt(row):
        return "  ".join(str(x).rjust(w) if num else str(x).ljust(w) for x, w, num in zip(row, widths, numeric)).rstrip()

    lines = [fmt(headers), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in rows]
    return "\n".join(lines)


def summary_table(records) -> str:
    rows = summary_rows(records)
    return format_table(_headers(rows), rows)


def unavailable_lines(records) -> list[str]:
    """One line per distinct (leg, reason) of unavailable records."""
    seen = defaultdict(int)
    for r in records:
        if r.status == UNAVAILABLE:
            seen[(r.leg, r.detail)] += 1
    return [f"unavailable: {leg}: {reason} ({n} records skipped)" for (leg, reason), n in sorted(seen.items())]


def skip_reasons(records) -> list[tuple[str, int, int]]:
    """``(reason, records, cases)`` for every distinct reason a record was skipped.

    Unavailable legs are listed by `unavailable_lines`; these are the other skips
    (e.g. GPU-only cases on a CPU machine), largest group first.
    """
    groups = defaultdict(lambda: [0, set()])
    for r in records:
        if r.status == SKIPPED:
            g = groups[r.detail or "(no reason given)"]
            g[0] += 1
            g[1].add(r.case_id)
    return sorted(((reason, n, len(ids)) for reason, (n, ids) in groups.items()), key=lambda x: (-x[1], x[0]))


def skip_lines(records) -> list[str]:
    """One console line per distinct skip reason, with its counts."""
    return [f"skipped: {reason} ({n} record(s), {k} case(s))" for reason, n, k in skip_reasons(records)]


def known_failures(records) -> list[tuple[str, int, list[str]]]:
    """``(reason, records, case ids)`` of the ``xfailed`` records, by reason, largest group first."""
    groups = defaultdict(lambda: [0, []])
    for r in records:
        if r.status == XFAILED:
            g = groups[r.metrics.get("known") or r.detail.splitlines()[0]]
            g[0] += 1
            if r.case_id not in g[1]:
                g[1].append(r.case_id)
    return sorted(((k, n, ids) for k, (n, ids) in groups.items()), key=lambda x: (-x[1], x[0]))


def known_failure_lines(records) -> list[str]:
    out = []
    for reason, n, ids in known_failures(records):
        shown = ", ".join(ids[:4]) + (f" and {len(ids) - 4} more" if len(ids) > 4 else "")
        out.append(f"known failure: {reason} ({n} record(s): {shown})")
    return out


def failure_text(r) -> str:
    """A failure: what failed, the worst element, and the repro line."""
    where = f"{r.case_id} [{r.op} {r.leg} {r.path}" + (f" {r.layer}" if r.layer else "") + "]"
    lines = [f"FAIL {where}: {r.detail.splitlines()[0] if r.detail else ''}"]
    if r.worst:
        lines.append(f"  worst: {r.worst}")
    if r.repro:
        lines.append(f"  repro: {r.repro}")
    return "\n".join(lines)


def console_report(records, legs_text, *, interrupted: str = "") -> str:
    out = ["legs:"] + [f"  {t}" for t in legs_text]
    out += ["", summary_table(records)]
    times = leg_seconds(records)
    if times:
        # With worker processes these are sums over the workers, not wall time.
        out += ["", "time per leg (summed over cases): " + ", ".join(f"{leg} {sec:.1f}s" for leg, sec in times)]
    un = unavailable_lines(records) + skip_lines(records)
    if un:
        out += [""] + un
    known = known_failure_lines(records)
    if known:
        out += [""] + known
    fails = [r for r in records if r.status == FAILED]
    if fails:
        out += ["", f"{len(fails)} failure(s):"] + [failure_text(r) for r in fails]
    if interrupted:
        out += ["", interrupted]
    out += ["", final_line(records)]
    return "\n".join(out)


def _jsonable(x):
    if dataclasses.is_dataclass(x):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(x).items()}
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (frozenset, set)):
        return sorted(_jsonable(v) for v in x)
    if hasattr(x, "tolist"):  # numpy scalars and arrays (a 0-d array's tolist is its scalar)
        return _jsonable(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return repr(x)  # "inf", "-inf" or "nan": strict JSON has no non-finite numbers
    return x


def _write_atomic(path: str, text: str) -> None:
    """Writes `text` to `path` through a temporary file in the same directory and a rename."""
    # Beside the target so the rename stays on one file system; plain open() keeps the umask's mode.
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_reports(directory: str, records, *, meta: dict, cases) -> tuple[str, str]:
    """Writes ``parity.json`` (one record per case x op x leg x path) and ``parity.md``."""
    os.makedirs(directory, exist_ok=True)
    json_path = os.path.join(directory, "parity.json")
    md_path = os.path.join(directory, "parity.md")
    case_info = {}
    for c in cases:
        d = _jsonable(c)
        d["id"] = c.id
        d["tags"] = sorted(c.all_tags)
        case_info[c.id] = d
    doc = {"meta": _jsonable(meta), "summary": tally(records), "cases": case_info,
           "records": [_jsonable(r.to_json()) for r in records]}
    # Serialised in full before anything is written: an error here leaves the old files intact.
    _write_atomic(json_path, json.dumps(doc, indent=1, allow_nan=False, default=str))
    _write_atomic(md_path, markdown(records, meta))
    return json_path, md_path


def markdown(records, meta: dict) -> str:
    lines = ["# Parity report", ""]
    for k in ("mode", "seed", "legs", "filter", "started", "seconds", "interrupted"):
        if k in meta:
            lines.append(f"- {k}: `{meta[k]}`")
    for t in meta.get("legs_text", []):
        lines.append(f"- leg: {t}")
    for k, v in meta.get("versions", {}).items():
        lines.append(f"- {k}: {v}")
    rows = summary_rows(records)
    heads = _headers(rows)
    lines += ["", f"**{final_line(records)}**", "", "| " + " | ".join(heads) + " |",
              "|---|---|---|" + "---:|" * (len(heads) - 3)]
    for row in rows:
        lines.append("| " + " | ".join(str(x) for x in row) + " |")
    ops = sorted({r.op for r in records}, key=lambda op: OP_ORDER.index(op) if op in OP_ORDER else len(OP_ORDER))
    if ops:
        lines += ["", "## Checks", "",
                  "Each record is one case x check (op) x leg x path. Legs: `reference` (tq_spec float64), "
                  "`torch`, `jax`; `a|b` compares two legs directly, `a->b` reads with b a cache written by a.", ""]
        lines += [f"- **{op}**: {OP_TEXT.get(op, '(no description)')}" for op in ops]
    un = unavailable_lines(records)
    skips = skip_reasons(records)
    if un or skips:
        lines += ["", "## Skipped", "", "Skipped records are never counted as passed.", ""]
        lines += [f"- unavailable leg: {u.removeprefix('unavailable: ')}" for u in un]
        lines += [f"- {reason} ({n} record(s), {k} case(s))" for reason, n, k in skips]
    known = known_failures(records)
    if known:
        lines += ["", "## Known failures", "",
                  "Tracked in the catalog with their reason (strict: one that passes fails the run as "
                  "`xpassed`, so the mark is removed). They do not fail the run.", ""]
        for reason, n, ids in known:
            lines.append(f"- {reason} ({n} record(s))")
            lines += [f"  - `{i}`" for i in ids]
    fails = [r for r in records if r.status == FAILED]
    if fails:
        lines += ["", "## Failures", "",
                  "Each with its worst element and the command that re-runs it.", ""]
        for r in fails:
            lines.append(f"- `{r.case_id}` {r.op} {r.leg} {r.path} {r.layer}".rstrip())
            lines.append(f"  - {r.detail.splitlines()[0] if r.detail else ''}")
            if r.worst:
                lines.append(f"  - worst: {r.worst}")
            if r.repro:
                lines.append(f"  - repro: `{r.repro}`")
    return "\n".join(lines) + "\n"
