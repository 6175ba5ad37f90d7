"""The ``cuda-graph`` check: the torch decode path captured in a CUDA graph, replayed with changing seq_lens.

vLLM captures decode steps in CUDA graphs and replays them with new metadata values in the same
buffers. The op must therefore take every data-dependent decision on the device: the split count
and launch shapes come from static shapes only, and nothing is read on the host (validation is off,
as it must be during capture). The check captures ``tq_torch.paged_attention(path="decode", out=...)``
once, then for several ``seq_lens`` (the case's own, each shortened, some to 0 with no query left
behind, then the case's own again) writes them into the captured buffer, replays, and compares the
replayed output with an eager call on the same inputs (bit for bit) and with the float64 reference
on the same bytes (within the attention bound). Needs a CUDA device; the case is GPU-only.
"""

from __future__ import annotations

import numpy as np

from .. import tolerances
from ..legs.base import Leg
from ..report.records import FAILED, PASSED, SKIPPED, Record
from ..runner.case_run import CaseRun, attention_metrics, failed_by, timed


def seq_len_variants(seq_lens: np.ndarray, q_lens: np.ndarray) -> list[np.ndarray]:
    """The case's seq_lens, each sequence shortened (never below its q_len), and the original again."""
    base = seq_lens.astype(np.int32)
    half = np.maximum(q_lens, base // 2).astype(np.int32)
    minimal = np.maximum(q_lens, np.minimum(base, 1)).astype(np.int32)
    return [base, half, minimal, base]


def check_cuda_graph(run: CaseRun, leg: Leg) -> list[Record]:
    if leg.name != "torch":
        return []
    if getattr(leg, "device", None) is None or leg.device.type != "cuda":
        return [run.record("cuda-graph", leg.name, "decode", SKIPPED, "needs a GPU (CUDA graphs)")]

    def go():
        import torch

        import tq_torch

        pr = run.problem
        try:
            q, bt, sl, qsl, sinks = run.dev_args(leg)
            cache = leg.put(run.attn_cache)
            kw = pr.attention_kwargs()
            kw["sinks"] = sinks
            if kw.get("rotation") is not None:
                kw["rotation"] = torch.as_tensor(kw["rotation"], device=leg.device)
            static_sl = sl.clone()
            out = torch.empty_like(q)

            def call(seq_lens, into=None):
                return tq_torch.paged_attention(q, cache, bt, seq_lens, qsl, path="decode", out=into,
                                                validate=False, **kw)

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: compiles and allocator state before capture
                    call(static_sl, out)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call(static_sl, out)
            q_lens = np.diff(pr.query_start_loc)
            worst, problems, metrics = None, [], {}
            for i, lens in enumerate(seq_len_variants(pr.seq_lens, q_lens)):
                static_sl.copy_(torch.from_numpy(lens).to(leg.device))
                graph.replay()
                torch.cuda.synchronize()
                replayed = leg.get(out)
                eager = leg.get(call(torch.from_numpy(lens).to(leg.device)))
                if replayed.shape != eager.shape or not np.array_equal(
                        replayed.view(np.uint8), eager.view(np.uint8)):
                    d = np.abs(replayed.astype(np.float64) - eager.astype(np.float64))
                    problems.append(f"replay {i} (seq_lens {lens.tolist()}) != eager: max diff {np.nanmax(d):.3e}")
                cmp = tolerances.check_attention(
                    replayed, pr.query, run.attn_cache, pr.block_table, lens, pr.query_start_loc,
                    compute_dtype=leg.compute_dtype(pr.case.dtype), **pr.attention_kwargs())
                metrics[f"replay{i}"] = attention_metrics(cmp)
                if not cmp.ok:
                    problems.append(f"replay {i} (seq_lens {lens.tolist()}) vs reference: {cmp.describe()}")
                    worst = worst or cmp.worst
        except Exception as e:
            return failed_by(run, "cuda-graph", leg.name, "decode", e)
        if problems:
            return run.record("cuda-graph", leg.name, "decode", FAILED, "; ".join(problems), metrics=metrics,
                              worst=worst or problems[0])
        return run.record("cuda-graph", leg.name, "decode", PASSED,
                          f"{len(metrics)} replays with changed seq_lens equal the eager calls and the reference",
                          metrics=metrics)
    return timed(go)
