"""The speed goals (issues 10 and 11, DESIGN.md section 7) as data, and their evaluation.

Each goal names a row role (`BenchRow.role`), a metric computed from the
results, a comparison and a target. Speed-ups are over torch SDPA bf16 on
contiguous K/V in the same run; torch compares event times (do_bench), jax
compares loop times, each against SDPA timed the same way
(`parity.bench.timing`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .shapes import HEADLINE


@dataclass(frozen=True)
class Goal:
    """One target: ``metric(role rows of preset, leg) <cmp> target``.

    metric:
      speedup         SDPA time / kernel time.
      speedup_vs_base speedup / the decode-base row's speedup (same preset and leg).
      graph_speedup   SDPA graph time / kernel graph time (torch; jax: loop times).
      host_us         host wall time of issuing one eager call.
      time_vs_base    kernel time / the decode-base row's time (same preset and leg).
      time_vs_sdpa    kernel time / SDPA time (full causal SDPA for windowed rows).
      store_gbps      bf16 K+V input bytes per second, GB/s.
      jax_vs_torch    jax loop time / torch loop time, on every row of the run.
    """

    name: str
    role: str
    metric: str
    cmp: str  # ">=" or "<="
    target: float
    presets: tuple[str, ...] = (HEADLINE,)
    legs: tuple[str, ...] = ("torch", "jax")


_DECODE = "decode B*ctx>=256k, Hq32/Hkv8/D128"
GOALS: tuple[Goal, ...] = (
    Goal(f"{_DECODE}: speed-up over SDPA", "decode-base", "speedup", ">=", 2.5, ("turboquant_4bit_nc",)),
    Goal(f"{_DECODE}: speed-up over SDPA", "decode-base", "speedup", ">=", 2.7, ("turboquant_k3v4_nc",)),
    Goal(f"{_DECODE}: speed-up over SDPA", "decode-base", "speedup", ">=", 3.0, ("turboquant_3bit_nc",)),
    Goal(f"{_DECODE}: speed-up over SDPA", "decode-base", "speedup", ">=", 2.0, ("turboquant_k8v4",)),
    Goal(f"{_DECODE}: speed-up over SDPA", "decode-base", "speedup", ">=", 0.95, ("bf16",)),
    Goal("decode D=256: speed-up / D=128 speed-up", "decode-d256", "speedup_vs_base", ">=", 0.8),
    Goal("decode GQA 1: speed-up / GQA 4 speed-up", "decode-gqa1", "speedup_vs_base", ">=", 0.8),
    Goal("decode GQA 8: speed-up / GQA 4 speed-up", "decode-gqa8", "speedup_vs_base", ">=", 0.8),
    Goal("decode B=1 ctx 4k: CUDA-graph speed-up over SDPA (graph)", "decode-b1", "graph_speedup", ">=", 0.9),
    Goal("decode B=1 ctx 4k: eager host overhead per call (us)", "decode-b1", "host_us", "<=", 25.0),
    Goal("multi-token decode q_len 4: time / q_len 1 time", "decode-q4", "time_vs_base", "<=", 1.3),
    Goal("prefill B=1 8k causal: time / SDPA flash causal", "prefill", "time_vs_sdpa", "<=", 1.5),
    Goal("prefill B=1 8k, window 4k: time / SDPA flash causal", "prefill-window", "time_vs_sdpa", "<=", 1.0),
    Goal("store T=32k: bf16 input GB/s", "store", "store_gbps", ">=", 1500.0,
         ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "bf16")),
)
JAX_VS_TORCH = Goal("tq_jax time / tq_torch time (every row)", "*", "jax_vs_torch", "<=", 1.15, (), ("jax",))


@dataclass
class GoalResult:
    goal: Goal
    preset: str
    leg: str
    measured: Optional[float]
    row: str
    note: str = ""

    @property
    def met(self) -> Optional[bool]:
        if self.measured is None:
            return None
        return self.measured >= self.goal.target if self.goal.cmp == ">=" else self.measured <= self.goal.target

    def to_dict(self) -> dict:
        return {"goal": self.goal.name, "metric": self.goal.metric, "target": f"{self.goal.cmp} {self.goal.target:g}",
                "preset": self.preset, "leg": self.leg, "row": self.row, "measured": self.measured,
                "met": self.met, "note": self.note}


def _metric(goal: Goal, r: dict, base: Optional[dict]) -> tuple[Optional[float], str]:
    m = goal.metric
    if m in ("speedup_vs_base", "time_vs_base"):
        if base is None or base.get("time_ms") is None:
            return None, "no decode-base result for this preset and leg in the run"
        if m == "time_vs_base":
            return (None if r.get("time_ms") is None else r["time_ms"] / base["time_ms"]), ""
        if r.get("speedup_sdpa") is None or not base.get("speedup_sdpa"):
            return None, "no SDPA speed-up"
        return r["speedup_sdpa"] / base["speedup_sdpa"], ""
    if m == "speedup":
        return r.get("speedup_sdpa"), ""
    if m == "graph_speedup":
        if r["leg"] == "torch":
            return r.get("speedup_sdpa_graph"), "" if r.get("speedup_sdpa_graph") else "no graph timing"
        return r.get("speedup_sdpa"), "jax: compiled call, loop times"
    if m == "host_us":
        return r.get("host_us"), ""
    if m == "time_vs_sdpa":
        s = r.get("speedup_sdpa")
        return (1.0 / s if s else None), ""
    if m == "store_gbps":
        return r.get("store_input_gbps"), ""
    raise ValueError(f"unknown goal metric {m!r}")


def evaluate(rows: list[dict]) -> list[GoalResult]:
    """Goal results for the kernel rows of a run (dicts as `parity.bench.run` records them)."""
    kernel = [r for r in rows if r["leg"] in ("torch", "jax")]
    by_role: dict[tuple[str, str, str], dict] = {}
    for r in kernel:
        if r.get("role"):
            by_role[(r["role"], r["preset"], r["leg"])] = r
    out = []
    for goal in GOALS:
        for preset in goal.presets:
            for leg in goal.legs:
                r = by_role.get((goal.role, preset, leg))
                if r is None:
                    continue
                if r["status"] != "ok":
                    out.append(GoalResult(goal, preset, leg, None, r["row"], f"not timed: {r['status']}"))
                    continue
                base = by_role.get(("decode-base", preset, leg))
                value, note = _metric(goal, r, base)
                out.append(GoalResult(goal, preset, leg, value, r["row"], note))
    times = {(r["row"], r["preset"], r["leg"]): r for r in kernel if r["status"] == "ok"}
    for (row, preset, leg), r in sorted(times.items()):
        t = times.get((row, preset, "torch"))
        if leg != "jax" or t is None or not t.get("loop_ms") or r.get("loop_ms") is None:
            continue
        out.append(GoalResult(JAX_VS_TORCH, preset, "jax", r["loop_ms"] / t["loop_ms"], row))
    return out
