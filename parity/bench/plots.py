"""PNG plots of a run (matplotlib, the optional ``bench`` extra; skipped with a note without it).

* ``speedup.png``: decode speed-up over SDPA bf16 against B*ctx, one line per preset and leg.
* ``roofline.png``: % of the copy roofline of every timed attention and store configuration.
* ``prefill.png``: prefill time against sequence length (kernels and SDPA).
"""

from __future__ import annotations

import os


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never a display
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_plots(rows: list[dict], directory: str) -> tuple[list[str], str]:
    """Writes the PNGs into `directory`; returns (file names written, a note when none could be)."""
    plt = _pyplot()
    if plt is None:
        return [], "matplotlib not installed (pip install -e .[bench]): plots skipped"
    os.makedirs(directory, exist_ok=True)
    ok = [r for r in rows if r["status"] == "ok"]
    written = []
    for name, draw in (("speedup.png", _speedup), ("roofline.png", _roofline), ("prefill.png", _prefill)):
        fig = draw(plt, ok)
        if fig is None:
            continue
        fig.tight_layout()
        fig.savefig(os.path.join(directory, name), dpi=110)
        plt.close(fig)
        written.append(name)
    return written, ""


def _main_geometry(rows) -> str:
    """The geometry of the decode-base goal row (Llama-3-8B; the tiny one under --smoke)."""
    return next((r["geometry"] for r in rows if r["role"] == "decode-base"), "llama3-8b")


def _speedup(plt, rows):
    pts, geo = {}, _main_geometry(rows)
    for r in rows:
        if r["op"] == "decode" and r["leg"] in ("torch", "jax") and r.get("speedup_sdpa") and not r["skew"] \
                and not r["window"] and r["geometry"] == geo and r["page"] == 16:
            pts.setdefault((r["preset"], r["leg"]), []).append((r["tokens"], r["speedup_sdpa"]))
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for (preset, leg), xy in sorted(pts.items()):
        xy.sort()
        ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", linestyle="-" if leg == "torch" else "--",
                label=f"{preset.replace('turboquant_', '')} {leg}")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("B * ctx (tokens)")
    ax.set_ylabel("speed-up over SDPA bf16 (x)")
    ax.set_title(f"decode, {geo}, page 16")
    ax.legend(fontsize=7, ncol=2)
    return fig


def _roofline(plt, rows):
    kern = [r for r in rows if r["leg"] in ("torch", "jax", "sdpa") and r.get("pct_roofline") is not None]
    if not kern:
        return None
    labels = [f"{r['row']} {r['preset'].replace('turboquant_', '')} {r['leg']}" for r in kern]
    fig, ax = plt.subplots(figsize=(9, max(3, 0.18 * len(kern))))
    colors = {"torch": "tab:blue", "jax": "tab:orange", "sdpa": "tab:gray"}
    ax.barh(range(len(kern)), [r["pct_roofline"] for r in kern], color=[colors[r["leg"]] for r in kern])
    ax.set_yticks(range(len(kern)))
    ax.set_yticklabels(labels, fontsize=5)
    ax.invert_yaxis()
    ax.axvline(65, color="red", linewidth=0.8, linestyle=":")  # DESIGN.md section 7: >= 65% of HBM
    ax.set_xlabel("% of the measured copy bandwidth")
    return fig


def _prefill(plt, rows):
    pts, geo = {}, _main_geometry(rows)
    for r in rows:
        if r["op"] == "prefill" and r["batch"] == 1 and not r["window"] and r["geometry"] == geo \
                and r["page"] == 16 and r.get("time_ms"):
            name = r["leg"] if r["leg"] in ("sdpa", "jax-dpa") else \
                f"{r['preset'].replace('turboquant_', '')} {r['leg']}"
            pts.setdefault(name, []).append((r["ctx"], r["time_ms"]))
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(7, 5))
    for name, xy in sorted(pts.items()):
        xy.sort()
        ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (causal prefill, B=1)")
    ax.set_ylabel("time (ms)")
    ax.set_title(f"prefill, {geo}")
    ax.legend(fontsize=7)
    return fig
