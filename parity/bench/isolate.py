"""GPU runs of several legs: one child process per leg, rows merged into one run.

With tq_torch and tq_jax in one process, host stalls from the other framework
(its compiler and runtime threads) reached the torch timings: on an H100 a
3bit_nc decode read 1.55 ms by do_bench, with p20-p80 1.22-4.11 ms, while the
loop timing of the same run was a steady 0.61 ms, and its torch-only run gave
0.59 ms. Each leg therefore runs in its own process, back to back on the same
GPU. The baselines (SDPA, jax's dot-product attention) come from the first
process that has them, so the torch ratios use the SDPA timed in the torch
process.
"""

from __future__ import annotations

import os
import subprocess
import sys

# Options of the parent that the children must not inherit (each takes a value).
_PARENT_ONLY = ("--legs", "--out", "--benchmarks-md", "--compare-json")


def child_argv(argv: list[str], leg: str, out: str) -> list[str]:
    """The parent's arguments for one leg's child: ``--legs leg --out out``, no page or comparison."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in _PARENT_ONLY:
            skip = True
            continue
        if a.startswith(tuple(o + "=" for o in _PARENT_ONLY)):
            continue
        kept.append(a)
    return kept + ["--legs", leg, "--out", out]


def merge_runs(docs: list[dict], command: str) -> tuple[dict, dict, list, list]:
    """``(environment, roofline, rows, notes)`` of children's bench.json documents, in leg order.

    Rows: every row of the first document, then each later document's rows of legs not seen
    yet (its own kernel leg and any baseline the earlier ones lacked). The environment is the
    first child's, with the framework versions any child imported and the parent's command.
    """
    env = dict(docs[0]["environment"])
    for doc in docs[1:]:
        for key, value in doc["environment"].items():
            if env.get(key) in (None, "not imported") and value != "not imported":
                env[key] = value
    env["command"] = command + "  (one process per leg, rows merged: parity/bench/isolate.py)"
    rows, seen = [], set()
    for doc in docs:
        fresh = [r for r in doc["rows"] if r["leg"] not in seen]
        seen |= {r["leg"] for r in doc["rows"]}
        rows += fresh
    notes = []
    for doc in docs:
        notes += [n for n in doc.get("notes", []) if n not in notes]
    return env, docs[0]["roofline"], rows, notes


def run_legs_apart(argv: list[str], legs: tuple[str, ...], out_root: str) -> tuple[int, list[dict]]:
    """Runs ``python -m parity.bench`` once per leg into ``out_root/<leg>``; ``(worst exit status, docs)``."""
    from .results import load

    status, docs = 0, []
    for leg in legs:
        out = os.path.join(out_root, leg)
        rc = subprocess.call([sys.executable, "-m", "parity.bench", *child_argv(argv, leg, out)])
        status = max(status, rc)
        path = os.path.join(out, "bench.json")
        if os.path.exists(path):
            docs.append(load(path))
        else:
            print(f"leg {leg}: its process wrote no results (exit status {rc})", file=sys.stderr)
            status = max(status, 1)
    return status, docs
