"""The benchmark loop: per row, inputs and baselines once; per preset, one cache, the gate, then timing.

Every result is a flat dict (one per row x preset x leg, plus one per
baseline), so JSON, Markdown, plots and goals read the same records.
Status: ``ok`` (checked, then timed), ``WRONG`` (failed the gate; not
timed), ``error`` (raised; not timed), ``skipped`` (over the memory budget,
with the reason).
"""

from __future__ import annotations

import gc
import traceback
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

import tq_spec

from .baselines import Baseline, copy_roofline, jax_dpa, sdpa
from .gate import AttentionGate, StoreGate, Verdict
from .inputs import RowInputs, build_inputs
from .legs import Prepared, compute_dtype
from .progress import BenchProgress
from .shapes import BenchRow


@dataclass
class RunOptions:
    seed: int = 0
    presets: Optional[tuple[str, ...]] = None
    budget_bytes: int = 24 * 2**30
    on_gpu: bool = False
    smoke: bool = False


@dataclass
class RunResult:
    rows: list[dict] = field(default_factory=list)
    roofline: dict = field(default_factory=dict)
    unavailable: list[str] = field(default_factory=list)


def row_fields(row: BenchRow) -> dict:
    g = row.geometry
    return {"row": row.id, "op": row.op, "role": row.role, "geometry": g.name, "hq": g.num_q_heads,
            "hkv": g.num_kv_heads, "d": g.head_dim, "batch": row.batch, "ctx": row.ctx, "page": row.page,
            "q_len": row.q_len if row.op == "multi" else None, "window": row.window, "skew": row.skew,
            "chunk": row.chunk if row.op in ("chunked", "mixed") else None, "tokens": row.tokens}


def attention_bytes(row: BenchRow, bytes_per_token_head: int) -> int:
    """Bytes an attention call must move: every key any query sees, once, plus query and output (bf16)."""
    g = row.geometry
    total = 0
    for s, q in row.seqs():
        lo = max(0, s - q - row.window + 1) if row.window else 0
        total += (s - lo) * g.num_kv_heads * bytes_per_token_head
    q_rows = sum(q for _, q in row.seqs())
    return total + 2 * q_rows * g.num_q_heads * g.head_dim * 2


def steps_of(rows, presets, n_legs: int) -> int:
    """Progress steps: per row one baseline step (attention rows), per preset one step per leg."""
    return sum((0 if r.op == "store" else 1) + n_legs * len(r.preset_list(presets)) for r in rows)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


class BenchRun:
    """Runs rows through bench legs (`parity.bench.legs`) and baselines."""

    def __init__(self, legs, options: RunOptions, device, progress: BenchProgress):
        self.legs, self.opt, self.device, self.progress = legs, options, device, progress
        self.result = RunResult()

    def run(self, rows) -> RunResult:
        self.result.roofline = copy_roofline(self.device, self.opt.on_gpu, self.opt.smoke)
        for row in rows:
            presets = row.preset_list(self.opt.presets)
            if not presets:
                continue
            need = row.memory_bytes(presets)
            if need > self.opt.budget_bytes:
                budget = self.opt.budget_bytes / 2**30
                self._skip(row, presets, f"needs ~{need / 2**30:.1f} GiB > budget {budget:.0f} GiB")
                continue
            try:
                self._row(row, presets)
            except Exception as e:  # inputs or baselines failed (e.g. out of memory): the run goes on
                self._row_failed(row, presets, e)
            finally:
                self._free()
        return self.result

    # -- one row ------------------------------------------------------------------------

    def _row(self, row: BenchRow, presets) -> None:
        inp = build_inputs(row, self.opt.seed, self.device)
        base = {}
        if row.op != "store":
            base = self._baselines(inp)
        for preset in presets:
            if row.op == "store":
                self._store(inp, preset)
            else:
                self._attention(inp, preset, base)

    def _baselines(self, inp: RowInputs) -> dict[str, Baseline]:
        out = {"sdpa": sdpa(inp, self.opt.on_gpu, self.opt.smoke)}
        if any(leg.name == "jax" for leg in self.legs):
            out["jax-dpa"] = jax_dpa(inp, self.opt.on_gpu, self.opt.smoke)
        row = inp.row
        for name, b in out.items():
            status = "ok" if b.timing else ("skipped" if b.notes.startswith("skipped") else "error")
            rec = self._record(row, "-", name, status, b.notes, b.timing)
            if b.timing:
                self._bandwidth(rec, attention_bytes(row, 2 * row.geometry.head_dim * 2))
            self.result.rows.append(rec)
        self.progress.step(f"{row.id} baselines", ", ".join(
            f"{n} {b.timing.best_ms():.3f} ms" if b.timing else f"{n}: {b.notes}" for n, b in out.items()))
        return out

    def _attention(self, inp: RowInputs, preset: str, base: dict[str, Baseline]) -> None:
        row = inp.row
        try:
            cache = self._write_cache(inp, preset)
            gate = AttentionGate(inp, cache, preset)
        except Exception as e:
            for leg in self.legs:
                self._fail(row, preset, leg.name, "error", f"cache/reference set-up failed: {_err(e)}")
            return
        slot = tq_spec.layout(preset, row.geometry.head_dim).slot_bytes
        for leg in self.legs:
            def check(p: Prepared, out, leg=leg) -> Verdict:
                return gate.check(p.sampled(out, gate.rows), p.all_finite(out), compute_dtype(leg))

            rec = self._gated(row, preset, leg, lambda leg=leg: leg.attention(inp, cache, preset), check)
            if rec["status"] == "ok":
                self._bandwidth(rec, attention_bytes(row, slot))
                self._speedups(rec, base)
        del cache

    def _store(self, inp: RowInputs, preset: str) -> None:
        row = inp.row
        key, value, slots = inp.store_kv_inputs()
        gate = StoreGate(key, value, slots, row.page, preset, self.opt.seed)
        g = row.geometry
        t = len(slots)
        in_bytes = 2 * t * g.num_kv_heads * g.head_dim * 2
        written = t * g.num_kv_heads * tq_spec.layout(preset, g.head_dim).slot_bytes
        for leg in self.legs:
            def check(p: Prepared, out) -> Verdict:
                return gate.check(p.sampled(out, gate.pages))

            rec = self._gated(row, preset, leg, lambda leg=leg: leg.store(inp, preset), check)
            rec["cache_bytes_written"] = written
            if rec["status"] == "ok":
                self._bandwidth(rec, in_bytes + written)
                rec["store_input_gbps"] = in_bytes / (rec["time_ms"] * 1e-3) / 1e9

    # -- helpers ------------------------------------------------------------------------

    def _gated(self, row, preset, leg, prepare, check) -> dict:
        """prepare -> first call -> gate -> timing; one record, one progress step."""
        what = f"{row.id} {preset} {leg.name}"
        try:
            p = prepare()
            out = p.first()
            verdict = check(p, out)
            del out
        except Exception as e:
            return self._fail(row, preset, leg.name, "error", _err(e), trace=traceback.format_exc(limit=6))
        if not verdict.ok:
            return self._fail(row, preset, leg.name, "WRONG", verdict.detail, verdict=verdict)
        try:
            timing = p.time(row.graph)
        except Exception as e:
            return self._fail(row, preset, leg.name, "error", "timing failed: " + _err(e))
        rec = self._record(row, preset, leg.name, "ok", verdict.detail, timing)
        rec.update(max_err=verdict.max_err, bound=verdict.bound)
        self.result.rows.append(rec)
        self.progress.step(what, f"{rec['time_ms']:.4f} ms" + (f" (compile {p.compile_s:.1f}s)" if p.compile_s else ""))
        return rec

    def _record(self, row, preset, leg, status, detail, timing) -> dict:
        rec = {**row_fields(row), "preset": preset, "leg": leg, "status": status, "check": detail}
        if timing is not None:
            # torch-side calls headline their event time (device time, L2 flushed) where taken.
            prefer = "event" if leg in ("torch", "sdpa") and timing.event else "loop"
            rec.update(timing=timing.to_dict(), time_ms=timing.best_ms(prefer), time_how=prefer,
                       loop_ms=timing.loop and timing.loop.median_ms, event_ms=timing.event and timing.event.median_ms,
                       graph_ms=timing.graph and timing.graph.median_ms, host_us=timing.host_us,
                       compile_s=timing.compile_s)
        return rec

    def _fail(self, row, preset, leg, status, detail, verdict: Verdict | None = None, trace: str = "") -> dict:
        rec = self._record(row, preset, leg, status, detail, None)
        if verdict is not None:
            rec.update(max_err=verdict.max_err, bound=verdict.bound)
        if trace:
            rec["trace"] = trace
        self.result.rows.append(rec)
        self.progress.note(f"{status}: {row.id} {preset} {leg}: {detail}")
        self.progress.step(f"{row.id} {preset} {leg}", status)
        return rec

    def _row_failed(self, row, presets, e: Exception) -> None:
        """Error records for every configuration of `row` that has none yet."""
        mine = [r for r in self.result.rows if r["row"] == row.id]
        if row.op != "store" and not any(r["leg"] in ("sdpa", "jax-dpa") for r in mine):
            self.progress.step(f"{row.id} baselines", "error")
        done = {(r["preset"], r["leg"]) for r in mine}
        for preset in presets:
            for leg in self.legs:
                if (preset, leg.name) not in done:
                    self._fail(row, preset, leg.name, "error", f"row set-up failed: {_err(e)}",
                               trace=traceback.format_exc(limit=6))

    def _skip(self, row, presets, reason) -> None:
        if row.op != "store":
            self.progress.step(f"{row.id} baselines", "skipped")
        for preset in presets:
            for leg in self.legs:
                self.result.rows.append(self._record(row, preset, leg.name, "skipped", reason, None))
                self.progress.step(f"{row.id} {preset} {leg.name}", "skipped")
        self.progress.note(f"skipped {row.id}: {reason}")

    def _bandwidth(self, rec: dict, nbytes: int) -> None:
        rec["bytes"] = nbytes
        rec["gbps"] = nbytes / (rec["time_ms"] * 1e-3) / 1e9
        rec["pct_roofline"] = 100.0 * rec["gbps"] / self.result.roofline["gbps"]

    @staticmethod
    def _speedups(rec: dict, base: dict[str, Baseline]) -> None:
        """torch: against SDPA event (and graph) time; jax: against SDPA and jax-dpa loop time."""
        s = base.get("sdpa")
        if s is not None and s.timing is not None:
            if rec["leg"] == "torch" and rec.get("event_ms") and s.timing.event:
                rec["speedup_sdpa"] = s.timing.event.median_ms / rec["event_ms"]
            elif rec.get("loop_ms") and s.timing.loop:
                rec["speedup_sdpa"] = s.timing.loop.median_ms / rec["loop_ms"]
            if rec.get("graph_ms") and s.timing.graph:
                rec["speedup_sdpa_graph"] = s.timing.graph.median_ms / rec["graph_ms"]
        j = base.get("jax-dpa")
        if j is not None and j.timing is not None and rec.get("loop_ms"):
            rec["speedup_jax_dpa"] = j.timing.loop.median_ms / rec["loop_ms"]

    def _write_cache(self, inp: RowInputs, preset: str):
        """The row's cache for `preset`, written by the first leg's store (torch when present).

        Both legs then read these same bytes; the gate checks attention on them,
        whoever wrote them (store correctness is the store rows' business).
        """
        writer = self.legs[0]
        slot = tq_spec.layout(preset, inp.row.geometry.head_dim).slot_bytes
        if writer.name == "torch":
            import torch

            cache = inp.new_cache(slot)
            for grp in inp.groups:
                k, v, slots = inp.group_tokens(grp)
                writer.ops.store_kv(k, v, cache, torch.from_numpy(slots.astype(np.int32)).to(inp.device),
                                    preset=preset)
            return cache
        import jax.numpy as jnp
        import torch.utils.dlpack

        from .inputs import to_jax

        g = inp.row.geometry
        cache = jnp.full((inp.batch.num_blocks, inp.row.page, g.num_kv_heads, slot), 0xFF, jnp.uint8)
        for grp in inp.groups:
            k, v, slots = inp.group_tokens(grp)
            cache = writer.ops.store_kv(to_jax(k), to_jax(v), cache, jnp.asarray(slots.astype(np.int32)),
                                        preset=preset)
        return torch.utils.dlpack.from_dlpack(cache)

    def _free(self) -> None:
        gc.collect()
        if self.opt.on_gpu:
            import torch

            torch.cuda.empty_cache()
