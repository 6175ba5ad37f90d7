"""Model cases: several layers in order, each with its own preset, window and head dim.

The class of bug: per-layer metadata (window, soft cap, preset, head dim)
taken from the wrong layer, or a compiled-kernel / parameter cache keyed on
too little (two layers with the same shapes but different windows). Each
layer is stored and attended in model order (KV-shared layers read an
earlier layer's cache with their own query, window and soft cap), and every
output is compared with the float64 reference for *that* layer's metadata
on the bytes the leg itself wrote.
"""

from __future__ import annotations

import numpy as np

from .. import tolerances
from ..catalog.cases import AttentionCase, ModelCase
from ..catalog.problem import build_problem, paged_batch
from ..catalog.sweeps import rng_for
from ..legs.base import Leg
from ..report.records import FAILED, PASSED, Record
from ..runner.case_run import CaseRun, attention_metrics, failed_by, timed


def layer_case(model: ModelCase, layer) -> AttentionCase:
    """The single-layer case a model layer amounts to (same batch, its own metadata)."""
    return AttentionCase(
        group=model.group, preset=layer.preset, head_dim=layer.head_dim,
        num_q_heads=layer.num_q_heads, num_kv_heads=layer.num_kv_heads,
        block_size=model.block_size, seqs=model.seqs, sliding_window=layer.sliding_window,
        logits_soft_cap=layer.logits_soft_cap, dtype=model.dtype, poison=model.poison,
        checks=("attention",), variant=layer.name,
    )


def layer_runs(model: ModelCase, seed: int) -> dict[str, CaseRun]:
    """One `CaseRun` per layer, all over one shared block table."""
    batch = paged_batch(model.seqs, model.block_size, rng=rng_for("model-batch", seed, model.id))
    return {
        layer.name: CaseRun(build_problem(layer_case(model, layer), seed, batch=batch, stream=model.id))
        for layer in model.layers
    }


def check_model(model: ModelCase, runs: dict[str, CaseRun], leg: Leg) -> list[Record]:
    """Runs the layers in order through `leg`; one store record per cache-owning layer
    and one attention record per layer."""
    records: list[Record] = []
    caches: dict[str, np.ndarray] = {}

    def rec(run, layer, path, status, detail, **kw):
        r = run.record("model", leg.name, path, status, detail, **kw)
        r.case_id = model.id
        r.layer = layer.name
        return r

    for layer in model.layers:
        run = runs[layer.name]
        if layer.reads_cache_of is None:
            def store(run=run, layer=layer):
                pr = run.problem
                try:
                    got = run.store(leg)
                    cmp = tolerances.compare_store(got, pr.key, pr.value, pr.cache_before, pr.slot_mapping,
                                                   **pr.store_kwargs())
                except Exception as e:
                    r = failed_by(run, "model", leg.name, "store", e)
                    r.case_id, r.layer = model.id, layer.name
                    return r
                caches[layer.name] = got
                return rec(run, layer, "store", PASSED if cmp.ok else FAILED, cmp.describe(),
                           metrics={"agreement": cmp.agreement}, worst="" if cmp.ok else "; ".join(cmp.problems))
            records += timed(store)

        def attend(run=run, layer=layer):
            owner = layer.reads_cache_of or layer.name
            if owner not in caches:
                return rec(run, layer, "auto", FAILED, f"no cache: the store of {owner} failed")
            try:
                cache = run.problem.hide(caches[owner])
                out = run.attend(leg, cache, "auto")
                cmp = run.compare(leg, out, cache)
            except Exception as e:
                r = failed_by(run, "model", leg.name, "auto", e)
                r.case_id, r.layer = model.id, layer.name
                return r
            what = f"{layer.name} ({layer.preset}, D={layer.head_dim}, window={layer.sliding_window}, " \
                   f"cap={layer.logits_soft_cap}" + (f", reads {owner}'s cache" if owner != layer.name else "") + "): "
            return rec(run, layer, "auto", PASSED if cmp.ok else FAILED, what + cmp.describe(),
                       metrics=attention_metrics(cmp), worst="" if cmp.ok else cmp.worst)
        records += timed(attend)
    return records
