"""Summaries and reports: the console table, failures with repro lines, JSON, Markdown."""

from __future__ import annotations

import dataclasses
import json
import os
from collections import defaultdict

from .records import FAILED, PASSED, SKIPPED, UNAVAILABLE, final_line, tally


# Display order: the comparisons in the order a case runs them, presets as tq_spec lists them.
OP_ORDER = ("store", "attention", "paths", "cross-store", "cross", "interchange", "e2e", "chunking", "model", "case")


def _sort_key(key):
    from tq_spec import PRESET_NAMES

    op, preset, path = key
    op_i = OP_ORDER.index(op) if op in OP_ORDER else len(OP_ORDER)
    pr_i = PRESET_NAMES.index(preset) if preset in PRESET_NAMES else len(PRESET_NAMES)
    path_i = (0 if path == "auto" else 1, int(path[6:]) if path.startswith("chunk=") else 0, path)
    return (op_i, op, pr_i, preset, path_i)


def summary_rows(records) -> list[tuple]:
    """``(op, preset, path, passed, failed, skipped)`` grouped, in display order."""
    groups = defaultdict(lambda: [0, 0, 0])
    for r in records:
        g = groups[(r.op, r.preset, r.path)]
        g[(PASSED, FAILED, SKIPPED).index(r.counted_as)] += 1
    return [(op, preset, path, *groups[(op, preset, path)]) for op, preset, path in sorted(groups, key=_sort_key)]


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
    return format_table(("op", "preset", "path", "passed", "failed", "skipped"), summary_rows(records))


def unavailable_lines(records) -> list[str]:
    """One line per distinct (leg, reason) of unavailable records."""
    seen = defaultdict(int)
    for r in records:
        if r.status == UNAVAILABLE:
            seen[(r.leg, r.detail)] += 1
    return [f"unavailable: {leg}: {reason} ({n} records skipped)" for (leg, reason), n in sorted(seen.items())]


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
    un = unavailable_lines(records)
    if un:
        out += [""] + un
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
    if isinstance(x, float) and x != x:
        return None
    if hasattr(x, "item"):
        return x.item()
    return x


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
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False, default=str)
    with open(md_path, "w") as f:
        f.write(markdown(records, meta))
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
    lines += ["", f"**{final_line(records)}**", "", "| op | preset | path | passed | failed | skipped |",
              "|---|---|---|---:|---:|---:|"]
    for op, preset, path, p, fl, s in summary_rows(records):
        lines.append(f"| {op} | {preset} | {path} | {p} | {fl} | {s} |")
    un = unavailable_lines(records)
    if un:
        lines += ["", "## Unavailable", ""] + [f"- {u.removeprefix('unavailable: ')}" for u in un]
    fails = [r for r in records if r.status == FAILED]
    if fails:
        lines += ["", "## Failures", ""]
        for r in fails:
            lines.append(f"- `{r.case_id}` {r.op} {r.leg} {r.path} {r.layer}".rstrip())
            lines.append(f"  - {r.detail.splitlines()[0] if r.detail else ''}")
            if r.worst:
                lines.append(f"  - worst: {r.worst}")
            if r.repro:
                lines.append(f"  - repro: `{r.repro}`")
    return "\n".join(lines) + "\n"
