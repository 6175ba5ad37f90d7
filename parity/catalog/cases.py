"""What one parity case is: a declarative, hashable description of a problem.

A case holds no arrays. `parity.catalog.problem.build_problem(case, seed)` turns it
into concrete inputs, reproducibly from ``(seed, case.id)``. Two kinds exist:

* `AttentionCase`: one attention layer: a varlen batch over one paged cache.
* `ModelCase`: several layers (each with its own preset, head dim, window,
  soft cap) run one after another, some reading another layer's cache, the
  shape of a real model (Gemma-like), to catch metadata taken from the wrong
  layer.

Ids are readable and stable: they are built from the fields, never from a
position in a list, so ``--filter <id>`` finds the same case on every run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

# Short preset names used in ids.
PRESET_SHORT = {
    "turboquant_k8v4": "k8v4",
    "turboquant_4bit_nc": "4bit",
    "turboquant_k3v4_nc": "k3v4",
    "turboquant_3bit_nc": "3bit",
    "bf16": "bf16",
    "fp16": "fp16",
}
DTYPE_SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}

# The comparisons a case can ask for (see parity.checks for what each means).
CHECK_NAMES = ("store", "attention", "paths", "cross", "e2e", "interchange", "chunking", "determinism",
               "cuda-graph")
DEFAULT_CHECKS = ("store", "attention", "paths", "cross", "e2e", "interchange")

# How query/key data are drawn (parity.catalog.problem):
#   normal         q, k, v ~ N(0, 1)
#   sharp          q ~ N(0, 1) * SHARP_QUERY_GAIN: logits of a few units, so a soft cap bites
#   very-negative  every visible logit below -5e4 (a finite -5e4 mask sentinel would win)
#   key-ties       keys on quantization boundaries and one float32 ulp either side: rotated unit
#                  coordinates on every codebook midpoint (mse presets), elements on fp8 rounding
#                  midpoints (k8v4); values on the uniform quantizer's half steps
#   fp8-saturate   k8v4 keys with elements of exactly +-448, 449, +-464, 480, +-1e4, +-inf (the clamp to
#                  +-448 before the fp8 cast)
#   value-lanes    values whose min or max sits in the last lanes of the head dim (padded tiles), and
#                  constant value vectors (the 1e-8 scale clamp)
#   nan-query      one query row with a NaN element and one with an Inf element (must propagate)
#   nan-sinks      sinks of NaN, +inf, -inf and 1e4 on the first heads (NaN/+inf propagate; -inf is no sink)
#   nan-values     NaN, +Inf and -Inf value elements of keys that some rows of the call see and others
#                  may not (a later token, one just out of the window): they reach exactly the rows that
#                  see them, never as 0 * NaN
DATA_MODES = ("normal", "sharp", "very-negative", "key-ties", "fp8-saturate", "value-lanes", "nan-query",
              "nan-sinks", "nan-values")
# Data modes the end-to-end distortion bounds are calibrated for (parity.checks.distortion).
E2E_DATA_MODES = ("normal", "sharp", "very-negative")
# Bytes written into every slot no token owns (unused pages, pages past seq_len,
# out-of-window slots): NaN in every float field, fp16 Inf / huge finite, bf16 Inf.
POISON_PATTERNS = {
    "nan": (0xFF,),
    "inf16": (0x00, 0x7C),
    "inf-bf16": (0x80, 0x7F),
}

Seqs = tuple[tuple[int, int], ...]


def seqs_label(seqs: Seqs) -> str:
    """``((9, 8), (33, 1))`` -> ``"s9q8+s33q1"``."""
    return "+".join(f"s{s}q{q}" for s, q in seqs) if seqs else "empty"


def _num(x: float) -> str:
    return f"{x:g}".replace(".", "p").replace("-", "m")


@dataclass(frozen=True)
class AttentionCase:
    """One attention problem over one paged cache.

    Attributes:
      group: the catalog entry that produced the case (first part of the id).
      preset: a `tq_spec.PRESET_NAMES` name.
      head_dim, num_q_heads, num_kv_heads, block_size: D, Hq, Hkv, P.
      seqs: ``(seq_len, q_len)`` per sequence; queries are the last q_len tokens.
      sliding_window, logits_soft_cap: None or the value passed to the op.
      sinks: whether to pass per-head sink logits.
      scale: None (1/sqrt(D)) or an explicit logit scale.
      dtype: query/key/value dtype name.
      rotation: ``"hadamard"`` (default, passed as None) or ``"randomized_hadamard"``
        (passed as data); mse presets only.
      codebook: ``"vllm"`` (default, passed as None) or ``"exact"`` (passed as a
        `tq_spec.Codebook`); mse presets only.
      data: one of `DATA_MODES`.
      poison: a `POISON_PATTERNS` key.
      far_pages: put every used page beyond byte offset 2**31 (GPU only: > 2 GiB cache).
      slot_dtype: int32 or int64 slot_mapping.
      checks: which comparisons to run (`CHECK_NAMES`).
      chunks: chunk sizes for the ``chunking`` check.
      gpu_only: skipped (with the reason) when no CUDA device is visible.
      pad_rows: query rows past query_start_loc[B] (NaN-filled; they must come back zeros).
      decode_splits: decode split counts forced as extra paths ``decode/splits=N`` (through
        the kernels' private split override; e.g. 1, and more splits than key tiles).
      shared_pages: sequences after the first share its first `shared_pages` pages (a repeated
        block table: prefix sharing; the shared tokens are the first sequence's).
      known: ``((leg, reason), ...)``: known failures of a leg on this case (strict xfail: its
        failed records become ``xfailed``; if none fails, an ``xpassed`` failure says so).
      tags: extra tags (the group, preset and feature tags are added automatically).
      variant: optional id suffix to keep ids unique.
      note: why the case exists (shown by ``--list``).
    """

    group: str
    preset: str
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    block_size: int
    seqs: Seqs
    sliding_window: Optional[int] = None
    logits_soft_cap: Optional[float] = None
    sinks: bool = False
    scale: Optional[float] = None
    dtype: str = "bfloat16"
    rotation: str = "hadamard"
    codebook: str = "vllm"
    data: str = "normal"
    poison: str = "nan"
    far_pages: bool = False
    slot_dtype: str = "int64"
    checks: tuple[str, ...] = DEFAULT_CHECKS
    chunks: tuple[int, ...] = ()
    gpu_only: bool = False
    pad_rows: int = 0
    decode_splits: tuple[int, ...] = ()
    shared_pages: int = 0
    known: tuple = ()
    tags: frozenset = field(default_factory=frozenset)
    variant: str = ""
    note: str = ""

    def __post_init__(self):
        if "e2e" in self.checks and self.data not in E2E_DATA_MODES:
            raise ValueError(f"checks: e2e bounds are calibrated for data {E2E_DATA_MODES}, not {self.data!r}")
        if self.pad_rows < 0 or self.shared_pages < 0 or any(n < 1 for n in self.decode_splits):
            raise ValueError("pad_rows, shared_pages: expected >= 0; decode_splits: expected counts >= 1")
        if self.pad_rows and ({"e2e", "chunking"} & set(self.checks)):
            raise ValueError("pad_rows: the e2e and chunking checks compare unpadded outputs")
        if self.shared_pages and "chunking" in self.checks:
            raise ValueError("shared_pages: the chunking check stores every sequence's tokens itself")
        for name in self.checks:
            if name not in CHECK_NAMES:
                raise ValueError(f"checks: unknown check {name!r}; expected one of {CHECK_NAMES}")
        if "chunking" in self.checks and not self.chunks:
            raise ValueError("chunks: the chunking check needs at least one chunk size")
        if self.data not in DATA_MODES:
            raise ValueError(f"data: expected one of {DATA_MODES}, got {self.data!r}")
        if self.poison not in POISON_PATTERNS:
            raise ValueError(f"poison: expected one of {tuple(POISON_PATTERNS)}, got {self.poison!r}")
        for s, q in self.seqs:
            if not 0 <= q <= s:
                raise ValueError(f"seqs: expected 0 <= q_len <= seq_len, got seq_len {s}, q_len {q}")

    @property
    def kind(self) -> str:
        return "attention"

    @property
    def num_tokens(self) -> int:
        """Query rows of the call, padding rows included (T, what dispatch sees)."""
        return sum(q for _, q in self.seqs) + self.pad_rows

    @property
    def id(self) -> str:
        parts = [
            PRESET_SHORT.get(self.preset, self.preset),
            f"d{self.head_dim}",
            f"h{self.num_q_heads}x{self.num_kv_heads}",
            f"p{self.block_size}",
            seqs_label(self.seqs),
        ]
        if self.sliding_window is not None:
            parts.append(f"w{self.sliding_window}")
        if self.logits_soft_cap is not None:
            parts.append(f"cap{_num(self.logits_soft_cap)}")
        if self.sinks:
            parts.append("sinks")
        if self.scale is not None:
            parts.append(f"scale{_num(self.scale)}")
        parts.append(DTYPE_SHORT.get(self.dtype, self.dtype))
        if self.rotation != "hadamard":
            parts.append("rh")
        if self.codebook != "vllm":
            parts.append(f"cb-{self.codebook}")
        if self.data != "normal":
            parts.append(self.data)
        if self.poison != "nan":
            parts.append(f"poison-{self.poison}")
        if self.far_pages:
            parts.append("far")
        if self.slot_dtype != "int64":
            parts.append("sm32")
        if self.chunks:
            parts.append("chunks" + "-".join(str(c) for c in self.chunks))
        if self.pad_rows:
            parts.append(f"pad{self.pad_rows}")
        if self.decode_splits:
            parts.append("splits" + "-".join(str(n) for n in self.decode_splits))
        if self.shared_pages:
            parts.append(f"shared{self.shared_pages}")
        if self.variant:
            parts.append(self.variant)
        return f"{self.group}:" + "-".join(parts)

    @property
    def all_tags(self) -> frozenset:
        """Group, preset, feature and batch-mix tags plus the explicit ones."""
        t = set(self.tags) | {self.group, self.preset, self.kind, f"d{self.head_dim}", self.dtype}
        t.add(f"gqa{self.num_q_heads // max(self.num_kv_heads, 1)}")
        t.add(f"page{self.block_size}")
        t.add(batch_mix(self.seqs))
        if self.sliding_window is not None:
            t.add("window")
        if self.logits_soft_cap is not None:
            t.add("softcap")
        if self.sinks:
            t.add("sinks")
        if self.gpu_only:
            t.add("gpu-only")
        if self.data != "normal":
            t.add(self.data)
        if self.pad_rows:
            t.add("padding")
        if self.decode_splits:
            t.add("splits")
        if self.shared_pages:
            t.add("shared-pages")
        if self.known:
            t.add("known-failure")
        t.update(self.checks)
        return frozenset(t)


@dataclass(frozen=True)
class LayerSpec:
    """One layer of a `ModelCase`.

    ``reads_cache_of`` names an earlier layer whose cache this layer attends
    (KV sharing); such a layer stores nothing and must match that layer's
    preset and head dim (its window and soft cap are its own).
    """

    name: str
    preset: str
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    sliding_window: Optional[int] = None
    logits_soft_cap: Optional[float] = None
    reads_cache_of: Optional[str] = None


@dataclass(frozen=True)
class ModelCase:
    """Several layers over one batch: every layer must get its own metadata.

    All layers share ``block_size``, ``seqs`` and the block table (as in a
    model: one table, one cache tensor per layer).
    """

    group: str
    name: str
    layers: tuple[LayerSpec, ...]
    block_size: int
    seqs: Seqs
    dtype: str = "bfloat16"
    poison: str = "nan"
    gpu_only: bool = False
    tags: frozenset = field(default_factory=frozenset)
    note: str = ""

    def __post_init__(self):
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError(f"layers: names must be unique, got {names}")
        owners = {}
        for layer in self.layers:
            if layer.reads_cache_of is not None:
                owner = owners.get(layer.reads_cache_of)
                if owner is None:
                    raise ValueError(
                        f"layers: {layer.name} reads the cache of {layer.reads_cache_of!r}, "
                        "which is not an earlier cache-owning layer"
                    )
                if (owner.preset, owner.head_dim, owner.num_kv_heads) != (
                    layer.preset, layer.head_dim, layer.num_kv_heads
                ):
                    raise ValueError(
                        f"layers: {layer.name} must use the preset, head_dim and num_kv_heads of "
                        f"{owner.name} whose cache it reads"
                    )
            else:
                owners[layer.name] = layer

    @property
    def kind(self) -> str:
        return "model"

    @property
    def checks(self) -> tuple[str, ...]:
        return ("model",)

    @property
    def id(self) -> str:
        return f"{self.group}:{self.name}-p{self.block_size}-{seqs_label(self.seqs)}-{DTYPE_SHORT[self.dtype]}"

    @property
    def all_tags(self) -> frozenset:
        t = set(self.tags) | {self.group, "model", batch_mix(self.seqs)}
        t.update(layer.preset for layer in self.layers)
        if self.gpu_only:
            t.add("gpu-only")
        return frozenset(t)


@dataclass(frozen=True)
class ErrorCase:
    """One row of the bad-input table (`parity.catalog.bad_inputs`), run by the ``errors`` check.

    The row itself (with its functions) is looked up by ``row_id``, so a case stays plain data.
    """

    row_id: str
    op_name: str
    row_kind: str
    what: str
    group: str = "errors"
    gpu_only: bool = False

    @property
    def kind(self) -> str:
        return "errors"

    @property
    def checks(self) -> tuple[str, ...]:
        return ("errors",)

    @property
    def preset(self) -> str:
        from .bad_inputs import BASE_PRESET

        return BASE_PRESET

    @property
    def id(self) -> str:
        return f"{self.group}:{self.row_id}"

    @property
    def all_tags(self) -> frozenset:
        return frozenset({self.group, "errors", self.op_name, self.row_kind})


Case = Union[AttentionCase, ModelCase, ErrorCase]


def batch_mix(seqs: Seqs) -> str:
    """Classifies a batch: decode, prefill, prefix-cached, mixed or empty."""
    kinds = set()
    for s, q in seqs:
        if q == 0:
            continue
        if q == 1 and s > 1:
            kinds.add("decode")
        elif q == s:
            kinds.add("prefill")
        else:
            kinds.add("prefix-cached")
    if not kinds:
        return "empty"
    return kinds.pop() if len(kinds) == 1 else "mixed"


def matches(case: Case, patterns) -> bool:
    """True when any pattern is a substring of the id or equals a tag."""
    if not patterns:
        return True
    tags = case.all_tags
    return any(p in case.id or p in tags for p in patterns)
