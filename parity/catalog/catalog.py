"""The parity catalog: regression classes from real bugs plus random sweeps.

Every entry is a declarative `Sweep` (fixed fields + axes, sampled by seed
where marked). ``quick`` shapes are tiny (CPU interpreters, a few minutes on
2 cores); ``full`` shapes are realistic (an H100 within minutes). Each
regression group names the bug it guards against (`GROUP_NOTES`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

import tq_spec

from .bad_inputs import bad_inputs
from .cases import DEFAULT_CHECKS, Case, ErrorCase, LayerSpec, ModelCase, matches
from .sweeps import MODES, Sweep, expand_all

QUANTIZED = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
ALL_PRESETS = tuple(tq_spec.PRESET_NAMES)
MSE_PRESETS = ("turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
CHUNK_SIZES = (1, 7, 16, 128)
# Quick mode runs the kernels in interpreters, where a store of many tokens
# and every new shape (a JAX compile) cost seconds: cases whose point is the
# attention path run only the attention comparisons there; store, e2e and
# interchange are covered by the cases that keep the default checks.
ATTENTION_ONLY = ("attention", "paths", "cross")

GROUP_NOTES = {
    "flashinfer-short": "FlashInfer fmha_v2 Q_PAGED_KV fell back to a non-paged kernel when max kv length < 16 "
                        "(GQA 14/2, D=64, page 16, seq 9, q_len 8 prefix-cached)",
    "window-paths": "sliding window dropped on one path: windows on decode, extend and continuation, <= and > 128",
    "model-gemma": "mixed-layer model (Gemma-like: 5 sliding D=256 + 1 global D=512, bf16 boundary layers, "
                   "KV-shared layers): each layer must get its own window, soft cap and preset",
    "very-negative": "finite -5e4 mask sentinel loses to very negative logits; rows with no visible key -> zeros",
    "tile-padding": "padding lanes entering the softmax when length % tile != 0 (and head dims padded to pow2)",
    "gqa": "GQA groups enumerated only {1,2,3,4,8}: ratios 1, 3, 5, 7, 16, 20, 32",
    "far-pages": "32-bit page offsets wrapped: every used page beyond byte 2**31 (GPU only, cache > 2 GiB)",
    "softcap-mask": "soft cap applied after masking (masked -inf becomes -cap and leaks)",
    "poison": "NaN/Inf in unused pages, out-of-window slots and pages past seq_len (0 * NaN)",
    "empty-splits": "empty split-KV partitions merged as garbage (short sequences next to long ones)",
    "window-edge": "window off-by-one between conventions: W and W +- 1 at the boundary, page edges",
    "bit-widths": "kernels hard-coded to one bit width: every preset at every head dim",
    "page-sizes": "non-power-of-two page sizes (1, 3, 48 from LCM page unification)",
    "chunking": "one prefill == the same tokens stored and attended in chunks of 1, 7, 16, 128",
    "params-as-data": "rotation and codebook passed as data (randomized Hadamard, exact Lloyd-Max)",
    "dtypes": "float16 / float32 queries and int32 slot mappings",
    "random": "random sweep: presets x head dims x pages x GQA x windows x soft cap x sinks x batch mixes",
    "key-ties": "exact rounding ties and one ulp either side: fp8/bf16 key elements on rounding midpoints, "
                "rotated key coordinates on codebook midpoints (within the boundary band the float32 "
                "normalization leaves), values on the uniform quantizer's half steps",
    "fp8-saturate": "fp8 keys beyond the e4m3fn range: exactly 448, 449, 464 (RNE would give 480), 1e4, +-inf; "
                    "the clamp to +-448 comes before the cast (torch/ml_dtypes give NaN, Hopper saturates)",
    "value-lanes": "value min/max in the last lanes of a padded head dim (D = 80, 96, 112) and constant "
                   "vectors (scale clamped to 1e-8, codes 0)",
    "splits": "decode with exactly one split and with more splits than key tiles (empty splits), both through "
              "the log-sum-exp merge (forced through the kernels' private split override)",
    "kv-heads": "caches of 8 and 16 kv heads (Llama-like rows): the decode's fast loads depend on the row's byte "
                "strides, so only these reach them (4bit_nc pages streamed by TMA boxes where rows are 16-byte "
                "multiples, each kv head's slots at its own offset mod 16); splits, sinks, windows, soft caps, "
                "padding rows and CUDA graphs on them",
    "sinks": "sinks as a class of their own on every path: single-split decode, short sequences, q_len 0 rows, "
             "windows",
    "softcap-small": "soft caps of 1-5: small enough that a cap applied after masking (or not at all) shows",
    "nan-propagation": "NaN/Inf in a visible query row, sink or value propagates as IEEE arithmetic does (never "
                       "zeros or finite garbage); -inf sinks are no sinks; a NaN/Inf value reaches only the rows "
                       "that see its key (not as 0 * NaN from a later token or one out of the window)",
    "padding": "padding rows past query_start_loc[B] (NaN queries that must come back zeros), q_len 0 and "
               "seq_len 0 requests, as CUDA-graph and bucketed batches carry; bitwise determinism",
    "cuda-graph": "the torch decode path captured in a CUDA graph and replayed with changing seq_lens equals "
                  "eager (GPU only)",
    "errors": "bad inputs (argument errors, metadata values that crashed or wrote out of bounds, torch tensors "
              "given to tq_jax, valid edge cases): the same error as the reference with validation, memory-safe "
              "without it, torch and jax agreeing (parity/catalog/bad_inputs.py)",
}


def _cycle(values, n):
    return [values[i % len(values)] for i in range(n)]


def _head_dim_ok(fields: dict) -> bool:
    try:
        tq_spec.layout(fields["preset"], fields["head_dim"])
    except ValueError:
        return False
    return True


# ------------------------------------------------------------------------- regressions


def _flashinfer_short() -> list[Sweep]:
    seq_lens = (1, 5, 9, 15, 16, 17, 25, 33)
    base = dict(head_dim=64, num_q_heads=14, num_kv_heads=2, block_size=16)
    quick_rows = [((s, min(8, s)),) for s in seq_lens]
    return [
        # The exact bug (seq 9, q_len 8, prefix-cached).
        Sweep("flashinfer-short", dict(base, seqs=((9, 8),)), {"preset": ("turboquant_4bit_nc",)},
              modes=("quick",)),
        # Every length in one varlen batch (the fallback looked at the batch's max kv length).
        Sweep("flashinfer-short", dict(base, seqs=tuple((s, min(8, s)) for s in seq_lens)),
              {"preset": ("turboquant_k8v4",)}, modes=("quick",)),
        # Full: the exact bug on every preset; every length alone (q_len 8 and decode, presets
        # cycled so each length meets several formats) and batched.
        Sweep("flashinfer-short", dict(base, seqs=((9, 8),)), {"preset": ALL_PRESETS}, modes=("full",)),
        Sweep("flashinfer-short", base,
              {("seqs", "preset"): list(zip(quick_rows, _cycle(ALL_PRESETS, 8)))
               + list(zip([((s, 1),) for s in seq_lens], _cycle(ALL_PRESETS[3:] + ALL_PRESETS[:3], 8)))},
              modes=("full",)),
        Sweep("flashinfer-short", base, {("seqs", "preset"): [
            (tuple((s, min(8, s)) for s in seq_lens), "turboquant_k8v4"),
            (tuple((s, min(8, s)) for s in seq_lens), "turboquant_3bit_nc"),
            (tuple((s, 1) for s in seq_lens), "turboquant_4bit_nc"),
            (tuple((s, 1) for s in seq_lens), "bf16")]}, modes=("full",)),
    ]


def _window_paths() -> list[Sweep]:
    quick = [
        # (seqs, window, preset, checks)
        (((150, 1),), 129, "turboquant_4bit_nc", ATTENTION_ONLY),  # decode, W > 128
        (((20, 20),), 7, "turboquant_k3v4_nc", ATTENTION_ONLY),    # extend (prefill), W <= 128
        (((140, 3),), 128, "turboquant_3bit_nc", ATTENTION_ONLY),  # continuation, W <= 128 (edge)
        (((40, 6),), 9, "bf16", ATTENTION_ONLY),                   # continuation, W <= 128
    ]
    full_windows = (64, 128, 129, 200)
    full_mixes = (((600, 1), (300, 1)), ((300, 300),), ((700, 40), (260, 33)))
    return [
        Sweep("window-paths", dict(head_dim=128, num_q_heads=8, num_kv_heads=2, block_size=16),
              {("seqs", "sliding_window", "preset", "checks"): quick}, modes=("quick",)),
        Sweep("window-paths", dict(head_dim=128, num_q_heads=8, num_kv_heads=2, block_size=16),
              # Every batch mix with a window <= 128 and one > 128 (the boundaries of
              # the dropped-window bugs), presets rotating.
              {("seqs", "sliding_window", "preset"): [
                  (mix, w, p) for (mix, w), p in zip(
                      [(m, w) for i, m in enumerate(full_mixes) for w in (full_windows[i % 2], full_windows[2 + i % 2])],
                      _cycle(ALL_PRESETS, 6))]},
              modes=("full",)),
    ]


def _model_gemma(mode: str) -> ModelCase:
    quick = mode == "quick"
    ws, wb = (5, 7) if quick else (512, 384)
    hs, hg = (4, 2) if quick else (8, 4)  # query heads; kv heads are hs // 2 and 1
    slide = lambda name, preset, w, cap=None: LayerSpec(name, preset, 256, hs, hs // 2, w, cap)  # noqa: E731
    layers = (
        slide("L0", "bf16", ws),                          # boundary layer, unquantized
        slide("L1", "turboquant_k3v4_nc", ws),
        slide("L2", "turboquant_k3v4_nc", wb, 30.0),      # same shapes as L1, other window + soft cap
        slide("L3", "turboquant_4bit_nc", ws),
        slide("L4", "turboquant_k8v4", ws),
        LayerSpec("L5", "turboquant_4bit_nc", 512, hg, 1, None),   # global layer
        LayerSpec("L6", "turboquant_k3v4_nc", 256, hs, hs // 2, ws + 2, None, reads_cache_of="L1"),
        LayerSpec("L7", "turboquant_4bit_nc", 512, hg, 1, None, 50.0, reads_cache_of="L5"),
        LayerSpec("L8", "bf16", 512, hg, 1, None),       # boundary layer, global, unquantized
    )
    if quick:  # interpreters: drop the second shared layer and the last boundary layer
        layers = layers[:7]
    seqs = ((13, 1), (9, 4), (6, 6)) if quick else ((900, 1), (400, 48), (160, 160))
    return ModelCase("model-gemma", f"gemma-like-{len(layers)}L", layers, block_size=16, seqs=seqs)


def _very_negative() -> list[Sweep]:
    seqs_q = ((12, 1), (0, 0), (7, 7), (9, 0))
    seqs_f = ((300, 1), (0, 0), (100, 100), (50, 0), (200, 17))
    base = dict(head_dim=64, num_q_heads=4, num_kv_heads=2, block_size=16, data="very-negative",
                checks=("store", "attention", "paths", "cross", "interchange"))
    return [
        Sweep("very-negative", dict(base, seqs=seqs_q), {"preset": ("turboquant_3bit_nc",)},
              modes=("quick",)),
        Sweep("very-negative", dict(base, seqs=seqs_f),
              {("preset", "sliding_window"): list(zip(ALL_PRESETS, _cycle((None, 33), 6)))}, modes=("full",)),
    ]


def _tile_padding() -> list[Sweep]:
    quick = [
        ("turboquant_k8v4", 40, 16, ((23, 13), (17, 1))),
        ("fp16", 96, 48, ((50, 17),)),
    ]
    full_dims = (40, 72, 96, 136, 200, 264, 392)
    return [
        Sweep("tile-padding", dict(num_q_heads=6, num_kv_heads=2),
              {("preset", "head_dim", "block_size", "seqs"): quick}, modes=("quick",)),
        Sweep("tile-padding", dict(num_q_heads=6, num_kv_heads=2, block_size=16,
                                   seqs=((257, 33), (129, 1), (47, 47))),
              {("preset", "head_dim"): list(zip(_cycle(("turboquant_k8v4", "bf16", "fp16"), 7), full_dims))},
              modes=("full",)),
        Sweep("tile-padding", dict(num_q_heads=6, num_kv_heads=2, block_size=48, head_dim=128),
              {"preset": QUANTIZED, "seqs": (((1025, 1), (513, 65), (31, 31)),)}, modes=("full",)),
    ]


def _gqa() -> list[Sweep]:
    ratios = (1, 3, 5, 7, 16, 20, 32)
    return [
        # Two kv heads, so a wrong head -> kv head mapping changes the answer.
        Sweep("gqa", dict(head_dim=64, num_kv_heads=2, block_size=16, seqs=((10, 1), (7, 3)), checks=ATTENTION_ONLY),
              {("num_q_heads", "preset"): [(6, "turboquant_k8v4"), (14, "turboquant_4bit_nc"),
                                           (40, "turboquant_3bit_nc"), (64, "bf16")]},
              modes=("quick",)),
        Sweep("gqa", dict(head_dim=128, block_size=16, seqs=((700, 1), (200, 31), (64, 64))),
              {("num_q_heads_ratio", "preset"): list(zip(ratios, _cycle(ALL_PRESETS, 7))), "num_kv_heads": (2, 4)},
              derive=lambda f, rng: {**{k: v for k, v in f.items() if k != "num_q_heads_ratio"},
                                     "num_q_heads": f["num_q_heads_ratio"] * f["num_kv_heads"]},
              modes=("full",)),
        # mse keys under groups of more than 16 query heads: decode tiles of 32 or 64 rows,
        # which take their own tile settings (tq_torch `config.decode_tiles`).
        Sweep("gqa", dict(head_dim=128, num_kv_heads=2, block_size=16, seqs=((700, 1), (200, 31), (64, 64))),
              {("num_q_heads", "preset"): [(64, "turboquant_4bit_nc"), (40, "turboquant_k3v4_nc")]},
              modes=("full",)),
    ]


def _far_pages() -> list[Sweep]:
    return [Sweep("far-pages", dict(head_dim=128, num_q_heads=8, num_kv_heads=2, block_size=16, far_pages=True,
                                    gpu_only=True, seqs=((40, 1), (33, 5), (17, 17)), sliding_window=None),
                  {"preset": ("turboquant_k8v4", "turboquant_4bit_nc", "bf16")},
                  )]


def _softcap_mask() -> list[Sweep]:
    return [
        Sweep("softcap-mask", dict(head_dim=64, num_q_heads=4, num_kv_heads=2, block_size=16, data="sharp",
                                   seqs=((20, 6), (9, 1))),
              {("preset", "logits_soft_cap", "sliding_window"): [("turboquant_k8v4", 5.0, 4)]}, modes=("quick",)),
        Sweep("softcap-mask", dict(head_dim=128, num_q_heads=8, num_kv_heads=2, block_size=16, data="sharp",
                                   seqs=((400, 20), (90, 1), (60, 60))),
              {"preset": ALL_PRESETS, "logits_soft_cap": (5.0, 30.0, 50.0), "sliding_window": (None, 37)},
              sample=9, modes=("full",)),
    ]


def _poison() -> list[Sweep]:
    return [
        Sweep("poison", dict(head_dim=64, num_q_heads=4, num_kv_heads=2, block_size=8, sliding_window=5,
                             seqs=((30, 2), (11, 1), (8, 0))),
              {("preset", "poison"): [("turboquant_4bit_nc", "inf16"), ("bf16", "inf-bf16")]}, modes=("quick",)),
        Sweep("poison", dict(head_dim=128, num_q_heads=8, num_kv_heads=2, block_size=16, sliding_window=100,
                             seqs=((900, 3), (130, 1), (64, 0), (250, 250))),
              {("preset", "poison"): list(zip(ALL_PRESETS, _cycle(("nan", "inf16", "inf-bf16"), 6)))},
              modes=("full",)),
    ]


def _empty_splits() -> list[Sweep]:
    return [
        Sweep("empty-splits", dict(head_dim=64, num_q_heads=8, num_kv_heads=2, block_size=16,
                                   seqs=((1, 1), (2, 1), (3, 1), (130, 1)), checks=ATTENTION_ONLY),
              {"preset": ("turboquant_k3v4_nc",)}, modes=("quick",)),
        Sweep("empty-splits", dict(head_dim=128, num_q_heads=8, num_kv_heads=2, block_size=16,
                                   seqs=((1, 1), (2, 1), (3, 1), (17, 1), (5000, 1))),
              {("preset", "sliding_window"): list(zip(ALL_PRESETS, _cycle((None, 2), 6)))}, modes=("full",)),
    ]


def _window_edge() -> list[Sweep]:
    quick_seqs = ((15, 1), (16, 2), (17, 1), (18, 3), (33, 5))
    full_seqs = ((127, 1), (128, 2), (129, 1), (130, 3), (257, 64), (64, 64))
    return [
        Sweep("window-edge", dict(head_dim=64, num_q_heads=4, num_kv_heads=2, block_size=16, seqs=quick_seqs,
                                  checks=ATTENTION_ONLY),
              {("sliding_window", "preset"): [(1, "turboquant_k8v4"), (16, "turboquant_3bit_nc")]}, modes=("quick",)),
        Sweep("window-edge", dict(head_dim=128, num_q_heads=8, num_kv_heads=2, block_size=16, seqs=full_seqs),
              {("sliding_window", "preset"): list(zip((1, 15, 16, 17, 63, 64, 65, 127, 128, 129),
                                                      _cycle(ALL_PRESETS, 10)))},
              modes=("full",)),
    ]


def _bit_widths() -> list[Sweep]:
    return [
        # Quick: every preset once (each bit width), head dims 64..512 spread over them.
        Sweep("bit-widths", dict(num_q_heads=4, num_kv_heads=2, block_size=16, seqs=((19, 1), (11, 5))),
              {("preset", "head_dim"): [("turboquant_k8v4", 128), ("turboquant_4bit_nc", 128),
                                        ("turboquant_k3v4_nc", 256), ("turboquant_3bit_nc", 64),
                                        ("bf16", 512), ("fp16", 64)]}, modes=("quick",)),
        Sweep("bit-widths", dict(num_q_heads=8, num_kv_heads=2, block_size=16,
                                 seqs=((1000, 1), (300, 40), (100, 100))),
              {"preset": ALL_PRESETS, "head_dim": (64, 128, 256, 512)},
              where=_head_dim_ok, modes=("full",)),
    ]


def _page_sizes() -> list[Sweep]:
    return [
        Sweep("page-sizes", dict(head_dim=64, num_q_heads=4, num_kv_heads=2),
              {("block_size", "seqs", "preset", "checks"): [
                  (1, ((9, 3), (5, 1)), "turboquant_4bit_nc", DEFAULT_CHECKS),
                  (3, ((10, 4), (7, 1)), "turboquant_k8v4", ATTENTION_ONLY),
                  (48, ((50, 2),), "turboquant_k3v4_nc", ATTENTION_ONLY)]},
              modes=("quick",)),
        Sweep("page-sizes", dict(head_dim=128, num_q_heads=8, num_kv_heads=2,
                                 seqs=((500, 1), (97, 33), (49, 49))),
              {("block_size", "preset"): list(zip((1, 3, 16, 48, 128) * 2, _cycle(ALL_PRESETS, 10)))},
              modes=("full",)),
    ]


def _chunking() -> list[Sweep]:
    checks = ("chunking",)
    return [
        Sweep("chunking", dict(head_dim=64, num_q_heads=4, num_kv_heads=2, block_size=16, checks=checks,
                               chunks=CHUNK_SIZES),
              {("preset", "seqs", "sliding_window"): [("turboquant_4bit_nc", ((20, 16), (9, 4)), 6)]},
              modes=("quick",)),
        Sweep("chunking", dict(head_dim=128, num_q_heads=8, num_kv_heads=2, block_size=16, checks=checks,
                               chunks=CHUNK_SIZES),
              {("preset", "seqs", "sliding_window"): [
                  ("turboquant_k8v4", ((300, 300),), None),
                  ("turboquant_3bit_nc", ((300, 300),), None),
                  ("turboquant_4bit_nc", ((400, 290), (150, 37)), 100),
                  ("bf16", ((400, 290), (150, 37)), 100)]},
              modes=("full",)),
    ]


def _params_as_data() -> list[Sweep]:
    return [
        Sweep("params-as-data", dict(head_dim=64, num_q_heads=4, num_kv_heads=2, block_size=16,
                                     seqs=((21, 1), (12, 6))),
              {("preset", "rotation", "codebook"): [("turboquant_4bit_nc", "randomized_hadamard", "vllm"),
                                                    ("turboquant_3bit_nc", "hadamard", "exact")]},
              modes=("quick",)),
        Sweep("params-as-data", dict(head_dim=128, num_q_heads=8, num_kv_heads=2, block_size=16,
                                     seqs=((800, 1), (200, 50))),
              {("preset", "rotation", "codebook"): [
                  ("turboquant_4bit_nc", "randomized_hadamard", "vllm"),
                  ("turboquant_k3v4_nc", "randomized_hadamard", "vllm"),
                  ("turboquant_3bit_nc", "hadamard", "exact"),
                  ("turboquant_4bit_nc", "hadamard", "exact"),
                  ("turboquant_k3v4_nc", "randomized_hadamard", "exact")]},
              modes=("full",)),
    ]


def _dtypes() -> list[Sweep]:
    return [
        Sweep("dtypes", dict(head_dim=64, num_q_heads=4, num_kv_heads=2, block_size=16, seqs=((14, 1), (9, 5))),
              {("preset", "dtype", "slot_dtype"): [("turboquant_k8v4", "float16", "int32"),
                                                   ("turboquant_k3v4_nc", "float32", "int64")]},
              modes=("quick",)),
        Sweep("dtypes", dict(head_dim=128, num_q_heads=8, num_kv_heads=2, block_size=16,
                             seqs=((600, 1), (100, 100))),
              {("preset", "dtype"): list(zip(ALL_PRESETS, _cycle(("float16", "float32"), 6))),
               "slot_dtype": ("int32",)},
              modes=("full",)),
    ]


# --------------------------------------------------------------- issue 14: inputs at the edges

STORE_AND_ATTENTION = ("store", "attention", "paths", "cross", "interchange")


def _key_ties() -> list[Sweep]:
    base = dict(num_q_heads=4, num_kv_heads=2, block_size=16, dtype="float32", data="key-ties",
                checks=STORE_AND_ATTENTION)
    return [
        Sweep("key-ties", dict(base, head_dim=64, seqs=((17, 3), (9, 1))),
              {"preset": ("turboquant_3bit_nc", "turboquant_k8v4")}, modes=("quick",)),
        Sweep("key-ties", dict(base, head_dim=128, seqs=((300, 20), (100, 1))),
              {"preset": ALL_PRESETS}, modes=("full",)),
    ]


def _fp8_saturate() -> list[Sweep]:
    base = dict(preset="turboquant_k8v4", num_q_heads=4, num_kv_heads=2, block_size=16, data="fp8-saturate",
                checks=STORE_AND_ATTENTION)
    return [
        Sweep("fp8-saturate", dict(base, head_dim=64, seqs=((12, 2), (7, 1))), {"dtype": ("float32",)},
              modes=("quick",)),
        Sweep("fp8-saturate", dict(base, head_dim=128, seqs=((200, 13), (64, 1))),
              {"dtype": ("float32", "bfloat16", "float16")}, modes=("full",)),
    ]


def _value_lanes() -> list[Sweep]:
    base = dict(num_q_heads=4, num_kv_heads=2, block_size=16, data="value-lanes", dtype="float32",
                checks=STORE_AND_ATTENTION)
    return [
        Sweep("value-lanes", dict(base, seqs=((13, 2), (6, 1))),
              {("preset", "head_dim", "checks"): [("turboquant_k8v4", 80, STORE_AND_ATTENTION),
                                                  ("bf16", 112, ATTENTION_ONLY)]},
              modes=("quick",)),
        Sweep("value-lanes", dict(base, seqs=((150, 30), (77, 1))),
              {"preset": ("turboquant_k8v4", "bf16", "fp16"), "head_dim": (80, 96, 112)}, modes=("full",)),
    ]


def _splits() -> list[Sweep]:
    return [
        # Forced: one split over several key tiles, and 9 splits: more than any sequence's key tiles
        # (40 tokens are 3 tiles of 16 keys in torch's interpreter, 2 of 32 in tq_jax).
        Sweep("splits", dict(head_dim=64, num_q_heads=4, num_kv_heads=2, block_size=16,
                             seqs=((40, 1), (3, 1), (17, 1), (0, 0)), decode_splits=(1, 9), checks=ATTENTION_ONLY),
              {"preset": ("turboquant_4bit_nc",)}, modes=("quick",)),
        # Natural: a block table of 16 tokens is one key tile, so the automatic count is one split.
        Sweep("splits", dict(head_dim=64, num_q_heads=6, num_kv_heads=2, block_size=8,
                             seqs=((8, 1), (5, 1), (1, 1)), checks=ATTENTION_ONLY),
              {"preset": ("turboquant_k8v4",)}, modes=("quick",)),
        Sweep("splits", dict(head_dim=128, num_q_heads=8, num_kv_heads=2, block_size=16,
                             seqs=((3000, 1), (17, 1), (1, 1), (0, 0)), decode_splits=(1, 64)),
              {"preset": ALL_PRESETS}, modes=("full",)),
        # Nine sequences: on a GPU, tq_jax decodes batches of 8 or more 4bit_nc sequences with its
        # packed-operand tiles (constant key-table entries), so forced counts reach that kernel too.
        Sweep("splits", dict(head_dim=128, num_q_heads=8, num_kv_heads=2, block_size=16,
                             seqs=((3000, 1), (17, 1), (1, 1), (0, 0), (700, 1), (64, 1), (33, 1), (2, 1),
                                   (129, 1)), decode_splits=(1, 64)),
              {"preset": ("turboquant_4bit_nc",)}, modes=("full",)),
        # D = 256 decode steps: on sm_90, tq_torch's Gluon decode reads the TurboQuant slots at this D too.
        Sweep("splits", dict(head_dim=256, num_q_heads=8, num_kv_heads=2, block_size=16,
                             seqs=((3000, 1), (17, 1), (1, 1), (0, 0)), decode_splits=(1, 64)),
              {"preset": ("turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "turboquant_k8v4")},
              modes=("full",)),
    ]


def _kv_heads() -> list[Sweep]:
    decode_mix = ((4100, 1), (1, 1), (17, 1), (0, 0), (300, 1), (16, 1), (33, 1))
    return [
        Sweep("kv-heads", dict(head_dim=64, num_q_heads=32, num_kv_heads=8, block_size=16,
                               seqs=((40, 1), (1, 1), (17, 1)), checks=ATTENTION_ONLY),
              {"preset": ("turboquant_4bit_nc",)}, modes=("quick",)),
        # Decode steps: every quantized preset at G = 4 over 8 kv heads and G = 2 over 16, natural and forced splits.
        Sweep("kv-heads", dict(head_dim=128, block_size=16, seqs=decode_mix, decode_splits=(1, 16)),
              {"preset": QUANTIZED, ("num_q_heads", "num_kv_heads"): [(32, 8), (32, 16)]}, modes=("full",)),
        # The staged 4bit_nc decode with sinks, a window, a soft cap; then tiles of several query tokens.
        Sweep("kv-heads", dict(preset="turboquant_4bit_nc", head_dim=128, num_q_heads=32, num_kv_heads=8,
                               block_size=16, checks=ATTENTION_ONLY),
              {("seqs", "sinks", "sliding_window", "logits_soft_cap", "data"): [
                  (decode_mix, True, None, None, "normal"), (decode_mix, False, 256, None, "normal"),
                  (decode_mix, False, None, 5.0, "sharp"), (((900, 3), (2000, 5), (40, 40)), False, None, None,
                                                            "normal")]},
              modes=("full",)),
        Sweep("kv-heads", dict(head_dim=128, num_q_heads=32, num_kv_heads=8, block_size=16, pad_rows=5,
                               seqs=((900, 1), (0, 0), (33, 1), (2, 1)), checks=STORE_AND_ATTENTION + ("determinism",)),
              {"preset": ("turboquant_4bit_nc", "turboquant_k3v4_nc")}, modes=("full",)),
        Sweep("kv-heads", dict(head_dim=128, num_q_heads=32, num_kv_heads=8, block_size=16, gpu_only=True,
                               seqs=((300, 1), (77, 1), (1, 1), (0, 0)), sinks=True, checks=("cuda-graph",)),
              {"preset": ("turboquant_4bit_nc",)}, modes=("full",)),
    ]


def _sinks() -> list[Sweep]:
    return [
        # Short sequences on 8-token pages: a 16-token block table is one key tile, so decode runs a
        # single split in both legs without forcing it.
        Sweep("sinks", dict(head_dim=64, num_q_heads=4, num_kv_heads=2, block_size=8, sinks=True,
                            seqs=((1, 1), (2, 1), (3, 1), (0, 0)), checks=ATTENTION_ONLY),
              {"preset": ("turboquant_k8v4",)}, modes=("quick",)),
        Sweep("sinks", dict(head_dim=64, num_q_heads=4, num_kv_heads=2, block_size=16, sinks=True,
                            sliding_window=6, seqs=((20, 8), (9, 1), (5, 0)), checks=ATTENTION_ONLY),
              {"preset": ("turboquant_4bit_nc",)}, modes=("quick",)),
        Sweep("sinks", dict(head_dim=128, num_q_heads=8, num_kv_heads=2, block_size=16, sinks=True,
                            decode_splits=(1,)),
              {"preset": ALL_PRESETS,
               ("seqs", "sliding_window"): [(((1, 1), (2, 1), (3, 1), (900, 1), (0, 0)), None),
                                            (((300, 300), (40, 7), (5, 0)), 64)]},
              modes=("full",)),
    ]


def _softcap_small() -> list[Sweep]:
    return [
        Sweep("softcap-small", dict(head_dim=64, num_q_heads=4, num_kv_heads=2, block_size=16, data="sharp",
                                    checks=ATTENTION_ONLY),
              {("preset", "logits_soft_cap", "sliding_window", "seqs"): [
                  ("turboquant_k3v4_nc", 1.0, 3, ((18, 5), (7, 1))),
                  ("bf16", 2.5, None, ((9, 9), (30, 1)))]},
              modes=("quick",)),
        Sweep("softcap-small", dict(head_dim=128, num_q_heads=8, num_kv_heads=2, block_size=16, data="sharp",
                                    seqs=((400, 20), (90, 1), (60, 60))),
              {"preset": ALL_PRESETS, "logits_soft_cap": (1.0, 2.0, 3.0, 5.0), "sliding_window": (None, 37)},
              sample=8, modes=("full",)),
    ]


def _nan_propagation() -> list[Sweep]:
    # A case a leg is known to fail gets known=(("torch", "<reason>"),): its failures are reported as
    # xfailed and a pass as an xpassed failure. tq_torch failed these until 7c4e0e7 (zeros for a NaN
    # query row, finite values for NaN/+inf sinks).
    return [
        Sweep("nan-propagation", dict(head_dim=64, num_q_heads=4, num_kv_heads=2, block_size=16, checks=ATTENTION_ONLY),
              {("preset", "data", "sinks", "seqs"): [
                  ("turboquant_4bit_nc", "nan-query", False, ((9, 3), (14, 1))),
                  ("bf16", "nan-query", False, ((5, 1), (6, 1), (7, 1))),
                  ("turboquant_k8v4", "nan-sinks", True, ((9, 3), (14, 1), (1, 1)))]},
              modes=("quick",)),
        Sweep("nan-propagation", dict(head_dim=128, num_q_heads=8, num_kv_heads=2, block_size=16,
                                      checks=ATTENTION_ONLY),
              {"preset": ALL_PRESETS,
               ("data", "sinks", "seqs"): [("nan-query", False, ((300, 40), (900, 1))),
                                           ("nan-sinks", True, ((300, 40), (900, 1), (1, 1)))]},
              modes=("full",)),
        Sweep("nan-propagation", dict(head_dim=64, num_q_heads=4, num_kv_heads=2, block_size=16, data="nan-values",
                                      checks=ATTENTION_ONLY),
              {("preset", "sliding_window", "seqs"): [
                  ("bf16", 6, ((24, 16), (30, 1))),
                  ("turboquant_4bit_nc", None, ((20, 12), (9, 1)))]},
              modes=("quick",)),
        Sweep("nan-propagation", dict(head_dim=128, num_q_heads=8, num_kv_heads=2, block_size=16, data="nan-values",
                                      checks=ATTENTION_ONLY),
              {"preset": ALL_PRESETS,
               ("sliding_window", "seqs"): [(None, ((300, 40), (900, 1))),
                                            (16, ((300, 40), (900, 1), (64, 64)))]},
              modes=("full",)),
    ]


def _padding() -> list[Sweep]:
    return [
        Sweep("padding", dict(head_dim=64, num_q_heads=4, num_kv_heads=2, block_size=16),
              {("preset", "seqs", "pad_rows", "checks"): [
                  ("turboquant_4bit_nc", ((9, 1), (0, 0), (5, 0), (12, 3)), 3,
                   ("store", "attention", "paths", "cross", "determinism")),
                  ("turboquant_k8v4", ((20, 1), (0, 0), (7, 1)), 1, ATTENTION_ONLY + ("determinism",))]},
              modes=("quick",)),
        Sweep("padding", dict(head_dim=128, num_q_heads=8, num_kv_heads=2, block_size=16,
                              checks=STORE_AND_ATTENTION + ("determinism",)),
              {"preset": ALL_PRESETS,
               ("seqs", "pad_rows"): [(((900, 1), (0, 0), (33, 0), (200, 1)), 60),
                                      (((300, 100), (0, 0), (64, 64)), 92)]},
              sample=6, modes=("full",)),
    ]


def _cuda_graph() -> list[Sweep]:
    return [Sweep("cuda-graph", dict(head_dim=128, num_q_heads=8, num_kv_heads=2, block_size=16, gpu_only=True,
                                     checks=("cuda-graph",)),
                  {("preset", "seqs", "sinks"): [
                      ("turboquant_4bit_nc", ((300, 1), (77, 1), (1, 1), (0, 0)), True),
                      ("turboquant_k8v4", ((1000, 1), (5, 1)), False),
                      ("bf16", ((64, 1), (640, 1), (0, 0)), False)]})]


# -------------------------------------------------------------------------- random sweep


def _mix_seqs(mix: str, rng: np.random.Generator, max_len: int, max_seqs: int) -> tuple:
    def length():
        return int(rng.integers(1, max_len + 1))

    n = int(rng.integers(1, max_seqs + 1))
    if mix == "decode":
        return tuple((length(), 1) for _ in range(n))
    if mix == "prefill":
        return tuple((s, s) for s in (min(length(), max_len // 2 + 1) for _ in range(n)))
    if mix == "prefix-cached":
        out = []
        for _ in range(n):
            s = max(3, length())
            out.append((s, int(rng.integers(2, s))))
        return tuple(out)
    # mixed: one of each, in random order
    parts = [_mix_seqs(m, rng, max_len, 1)[0] for m in ("decode", "prefill", "prefix-cached")]
    return tuple(parts[i] for i in rng.permutation(3))


def _random(mode: str) -> Sweep:
    quick = mode == "quick"
    max_len, max_seqs = (40, 3) if quick else (1200, 5)

    def derive(f, rng):
        f = dict(f)
        f["seqs"] = _mix_seqs(f.pop("mix"), rng, max_len, max_seqs)
        f["num_q_heads"] = f.pop("gqa") * f["num_kv_heads"]
        if f["logits_soft_cap"] is not None:
            f["data"] = "sharp"
        return f

    return Sweep(
        "random",
        dict(),
        {
            "preset": ALL_PRESETS,
            "head_dim": (64, 128, 256) if quick else (64, 96, 128, 256, 512),
            "block_size": (1, 16, 48) if quick else (1, 16, 32, 48, 128),
            "gqa": (1, 2, 3, 7) if quick else (1, 2, 4, 6, 7, 8),
            "num_kv_heads": (1, 2) if quick else (1, 2, 4),
            "sliding_window": (None, 4, 16) if quick else (None, 1, 64, 256, 1024),
            "logits_soft_cap": (None, 20.0),
            "sinks": (False, True),
            "dtype": ("bfloat16", "float16", "float32"),
            "mix": ("decode", "prefill", "mixed", "prefix-cached"),
        },
        sample=3 if quick else 20,
        where=_head_dim_ok,
        derive=derive,
        modes=(mode,),
    )


# ----------------------------------------------------------------------------- catalog


def sweeps(mode: str) -> list:
    """Every sweep (and model case) of `mode`, in catalog order."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    return [
        *_flashinfer_short(), *_window_paths(), *_very_negative(), *_tile_padding(), *_gqa(), *_far_pages(),
        *_softcap_mask(), *_poison(), *_empty_splits(), *_window_edge(), *_bit_widths(), *_page_sizes(),
        *_chunking(), *_params_as_data(), *_dtypes(), *_key_ties(), *_fp8_saturate(), *_value_lanes(),
        *_splits(), *_kv_heads(), *_sinks(), *_softcap_small(), *_nan_propagation(), *_padding(), *_cuda_graph(),
        _random(mode),
    ]


def error_cases() -> list[ErrorCase]:
    """One ``errors`` case per row of the bad-input table (the same in every mode: the rows are tiny)."""
    return [ErrorCase(r.id, r.op, r.kind, r.what) for r in bad_inputs()]


def build_catalog(mode: str, seed: int = 0) -> list[Case]:
    """All cases of `mode` for `seed` (ids unique, order stable)."""
    cases = expand_all(sweeps(mode), mode, seed)
    model = _model_gemma(mode)
    if all(c.id != model.id for c in cases):
        cases.insert(len([c for c in cases if c.group in ("flashinfer-short", "window-paths")]), model)
    return cases + error_cases()


def select(cases: Sequence[Case], patterns) -> list[Case]:
    """Cases whose id contains, or whose tags include, any of `patterns` (all if none)."""
    return [c for c in cases if matches(c, patterns)]
