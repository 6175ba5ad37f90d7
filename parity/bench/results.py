"""Results on disk: ``bench.json`` (everything) and ``bench.md`` / BENCHMARKS.md (the tables).

The JSON holds the run's environment (device, driver, library versions, git
commit, the exact command, the label), the copy roofline, every record of
`parity.bench.run` and the goal results. Non-finite floats become null, so the
file is valid JSON whatever a run measured.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys

from .goals import GoalResult
from .shapes import OP_NOTES, OPS


def environment(on_gpu: bool, argv: list[str], label: str) -> dict:
    """Device, driver, versions, commit, date and the command line of this run."""
    env = {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "command": "python -m parity.bench " + " ".join(shlex.quote(a) for a in argv), "label": label,
           "python": platform.python_version(), "platform": platform.platform()}
    for name in ("torch", "triton", "jax", "jaxlib", "numpy"):
        mod = sys.modules.get(name)
        env[name] = str(getattr(mod, "__version__", "?")) if mod else "not imported"
    env["device"], env["driver"] = "CPU (interpreters)", "-"
    if on_gpu:
        import torch

        env["device"] = torch.cuda.get_device_name(0)
        env["cuda"] = str(torch.version.cuda)
        env["driver"] = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]) or "?"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    commit = _run(["git", "-C", root, "rev-parse", "HEAD"])
    dirty = _run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"])
    env["git_commit"] = (commit or "?") + (" (with uncommitted changes)" if dirty else "")
    return env


def _run(cmd) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
    except Exception:
        return ""


def _finite(x):
    """JSON-safe copy: non-finite floats -> None."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_json(path: str, env: dict, roofline: dict, rows: list[dict], goals: list[GoalResult],
               notes: list[str]) -> None:
    doc = {"environment": env, "roofline": roofline, "notes": notes, "rows": rows,
           "goals": [g.to_dict() for g in goals]}
    with open(path, "w") as f:
        json.dump(_finite(doc), f, indent=1, allow_nan=False)


# ---------------------------------------------------------------------------- Markdown


def _f(x, fmt="{:.3f}", none="-") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return fmt.format(x)


def _table(head: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def goal_table(goals: list[GoalResult]) -> str:
    body = []
    for g in goals:
        met = {True: "met", False: "**not met**", None: "n/a"}[g.met]
        body.append([g.goal.name, g.preset.replace("turboquant_", ""), g.leg, g.row, _f(g.measured, "{:.3g}"),
                     f"{g.goal.cmp} {g.goal.target:g}", met + (f" ({g.note})" if g.note else "")])
    return _table(["goal", "preset", "leg", "row", "measured", "target", "result"], body)


def _index(rows):
    by = {}
    for r in rows:
        by.setdefault((r["row"], r["preset"]), {})[r["leg"]] = r
    return by


def _time_cell(r) -> str:
    if r is None:
        return "-"
    if r["status"] != "ok":
        return r["status"]
    return _f(r.get("time_ms"), "{:.4f}")


def attention_table(rows: list[dict], op: str) -> str:
    kernel = [r for r in rows if r["op"] == op and r["leg"] in ("torch", "jax")]
    by = _index(rows)
    body, seen = [], set()
    for r in kernel:
        key = (r["row"], r["preset"])
        if key in seen:
            continue
        seen.add(key)
        t, j = by[key].get("torch"), by[key].get("jax")
        sd, jd = by.get((r["row"], "-"), {}).get("sdpa"), by.get((r["row"], "-"), {}).get("jax-dpa")

        def get(x, k, fmt="{:.2f}"):
            return _f(x.get(k), fmt) if x and x["status"] == "ok" else "-"

        ratio = (j["loop_ms"] / t["loop_ms"] if t and j and t["status"] == j["status"] == "ok"
                 and t.get("loop_ms") and j.get("loop_ms") else None)
        body.append([r["row"], r["preset"].replace("turboquant_", ""), _time_cell(t), get(t, "graph_ms", "{:.4f}"),
                     _time_cell(j), _time_cell(sd), get(sd, "graph_ms", "{:.4f}"), _time_cell(jd),
                     get(t, "speedup_sdpa"), get(j, "speedup_sdpa"), get(t, "pct_roofline", "{:.0f}"),
                     get(j, "pct_roofline", "{:.0f}"), _f(ratio, "{:.2f}"), get(t, "host_us", "{:.0f}"),
                     get(j, "host_us", "{:.0f}"), get(j, "compile_s", "{:.1f}")])
    head = ["row", "preset", "torch ms", "torch graph ms", "jax ms", "SDPA ms", "SDPA graph ms", "jax-dpa ms",
            "torch x SDPA", "jax x SDPA", "torch % roof", "jax % roof", "jax/torch", "torch host us",
            "jax host us", "jax compile s"]
    return _table(head, body)


def store_table(rows: list[dict]) -> str:
    by = _index([r for r in rows if r["op"] == "store"])
    body = []
    for (row, preset), legs in by.items():
        t, j = legs.get("torch"), legs.get("jax")

        def get(x, k, fmt):
            return _f(x.get(k), fmt) if x and x["status"] == "ok" else "-"

        written = next((x.get("cache_bytes_written") for x in (t, j) if x), None)
        body.append([row, preset.replace("turboquant_", ""), _time_cell(t), _time_cell(j),
                     get(t, "store_input_gbps", "{:.0f}"), get(j, "store_input_gbps", "{:.0f}"),
                     get(t, "pct_roofline", "{:.0f}"), get(j, "pct_roofline", "{:.0f}"),
                     _f(written and written / 2**20, "{:.1f}"), get(j, "compile_s", "{:.1f}")])
    head = ["row", "preset", "torch ms", "jax ms", "torch GB/s (bf16 in)", "jax GB/s (bf16 in)",
            "torch % roof", "jax % roof", "cache MiB written", "jax compile s"]
    return _table(head, body)


def baseline_notes(rows: list[dict]) -> str:
    """Which implementation each baseline used, per row (flash forced or refused, cudnn or xla)."""
    by: dict[str, dict[str, str]] = {}
    for r in rows:
        if r["leg"] in ("sdpa", "jax-dpa"):
            by.setdefault(r["row"], {})[r["leg"]] = r["check"]
    body = [[row, d.get("sdpa", "-"), d.get("jax-dpa", "-")] for row, d in by.items()]
    return _table(["row", "sdpa", "jax-dpa"], body)


def problems(rows: list[dict]) -> str:
    """WRONG / error / skipped records with their reason (kept out of the tables' numbers)."""
    lines = []
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"- **{r['status']}** `{r['row']}` {r['preset']} {r['leg']}: {r['check']}")
    return "\n".join(lines) if lines else "None: every configuration passed its check and was timed."


METHOD = """\
How to read this:
- Every kernel configuration was first checked against the float64 reference (`tq_spec.reference`) on the
  same cache bytes, on sampled sub-problems (a few sequences / query-row windows), with the attention bounds
  of `parity/tolerances.py`; the whole output must also be finite. A WRONG row was not timed.
- torch times: `triton.testing.do_bench` median (L2 flushed, CUDA events); graph: `do_bench_cudagraph`.
  jax times: AOT-compiled call, median over repeats of N back-to-back calls ended by `block_until_ready`
  (compile time listed separately). `jax/torch` and jax speed-ups compare loop times with loop times.
- SDPA: `torch.nn.functional.scaled_dot_product_attention` bf16 on contiguous K/V with `enable_gqa`
  (flash backend forced; the backend used is in bench.json); jax-dpa: `jax.nn.dot_product_attention` (cudnn, else xla).
- % roof: (compressed cache bytes of the keys any query sees + query + output bytes) / time, over the
  measured device copy bandwidth (bytes read + written). Store GB/s: bf16 K+V input bytes per second.
- host us: host wall time of issuing one eager call (no sync)."""


def comparison_table(before: dict, rows: list[dict]) -> str:
    """Kernel rows of this run against the same (row, preset, leg) of an earlier run ``before``.

    Speed-up is the earlier time over this one (> 1: faster now); times are
    each run's preferred measure (events for torch, loop for jax).
    """
    old = {(r["row"], r["preset"], r["leg"]): r for r in before["rows"]}
    body = []
    for r in rows:
        if r["preset"] == "-" or r["status"] != "ok":
            continue
        b = old.get((r["row"], r["preset"], r["leg"]))
        before_ms = b["time_ms"] if b and b["status"] == "ok" else None
        gain = before_ms / r["time_ms"] if before_ms and r["time_ms"] else None
        why = "" if b is None else ("" if b["status"] == "ok" else f"before: {b['status']} ({b['check'][:60]})")
        body.append([r["row"], r["preset"], r["leg"], _f(before_ms, "{:.4f}"), _f(r["time_ms"], "{:.4f}"),
                     _f(gain, "{:.2f}x"), why])
    env = before["environment"]
    head = (f"Against the run labelled `{env.get('label') or '-'}` ({env['device']}, {env['date_utc']}), "
            f"command `{env['command']}`.\n\n")
    return head + _table(["row", "preset", "leg", "before ms", "now ms", "speed-up", "note"], body)


def markdown(env: dict, roofline: dict, rows: list[dict], goals: list[GoalResult], notes: list[str],
             plots: list[str] = (), title: str = "parity.bench results", before: dict | None = None) -> str:
    out = [f"# {title}", ""]
    out += [f"- device: {env['device']} (driver {env['driver']}{', CUDA ' + env['cuda'] if env.get('cuda') else ''})",
            f"- date: {env['date_utc']}; label: {env['label'] or '-'}",
            f"- versions: python {env['python']}, torch {env['torch']}, triton {env['triton']}, jax {env['jax']}, "
            f"jaxlib {env['jaxlib']}, numpy {env['numpy']}",
            f"- commit (as git on the benchmark machine saw it; the label names the code when that copy is stale): "
            f"{env['git_commit']}",
            f"- command: `{env['command']}`",
            f"- copy roofline: {roofline.get('gbps', 0):.0f} GB/s ({roofline.get('how', '')})"]
    out += [f"- note: {n}" for n in notes]
    out += ["", "## Goals", "", goal_table(goals), ""]
    if before is not None:
        out += ["## Before / after", "", comparison_table(before, rows), ""]
    for op in OPS:
        if not any(r["op"] == op for r in rows):
            continue
        out += [f"## {op}: {OP_NOTES[op]}", ""]
        out += [store_table(rows) if op == "store" else attention_table(rows, op), ""]
    out += ["## Not timed", "", problems(rows), "", "## Baselines", "", baseline_notes(rows), "",
            "## Method", "", METHOD, ""]
    if plots:
        out += ["## Plots", ""] + [f"![{os.path.splitext(os.path.basename(p))[0]}]({p})" for p in plots] + [""]
    return "\n".join(out)


def load(path: str) -> dict:
    """A ``bench.json`` written by `write_json`."""
    with open(path) as f:
        return json.load(f)
