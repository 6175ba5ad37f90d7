"""The benchmark's shapes, as a declarative table.

A `BenchRow` is one shape of one op; it is timed for every preset it names
and every leg. `quick_rows()` holds only the rows that decide the goals
(`parity.bench.goals`), `full_rows()` sweeps the rest, `smoke_rows()` runs
every op at tiny sizes in the CPU interpreters. Block tables are always
random permutations of the page pool (`parity.catalog.problem.paged_batch`),
never contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import tq_spec

OPS = ("decode", "multi", "prefill", "chunked", "mixed", "store")
OP_NOTES = {
    "decode": "one query per sequence (q_len 1)",
    "multi": "uniform multi-token decode (speculative decoding: q_len 2-8 per sequence)",
    "prefill": "q_len = seq_len, causal (whole prompt in one call)",
    "chunked": "chunked-prefill continuation: a chunk of new tokens over a long cached prefix",
    "mixed": "mixed batch: decodes plus one prefill chunk in one call",
    "store": "store_kv of T tokens (quantize + scatter into the paged cache)",
}
MAIN_PRESETS = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "bf16")
HEADLINE = "turboquant_4bit_nc"
DEFAULT_BUDGET_GIB = 24.0


@dataclass(frozen=True)
class Geometry:
    """Attention head geometry of one model family (query dtype is always bf16)."""

    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


LLAMA3_8B = Geometry("llama3-8b", 32, 8, 128)
GEOMETRIES = {g.name: g for g in (
    LLAMA3_8B,
    Geometry("gqa1-d128", 8, 8, 128),        # no grouping: every query head reads its own kv head
    Geometry("gqa8-d128", 32, 4, 128),
    Geometry("d256-gqa4", 16, 4, 256),       # D=256 at the same group size as Llama-3-8B
    Geometry("gemma-hkv1", 8, 1, 256),       # Gemma-like, multi-query
    Geometry("gemma-hkv4", 8, 4, 256),
    Geometry("d512", 16, 2, 512),
    Geometry("smoke", 4, 2, 64),
)}


def _k(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 and tokens >= 1024 else str(tokens)


@dataclass(frozen=True)
class BenchRow:
    """One shape of one op.

    Per op, ``ctx`` is: decode/multi/mixed: the context (seq_len) of each
    sequence; prefill: the prompt length; chunked: the cached prefix before
    the chunk; store: tokens per sequence (T = batch * ctx).

    Attributes:
      role: the goal this row decides (`parity.bench.goals`), "" for none.
      skew: seq_lens spread from ctx/4 to 7ctx/4 (same total tokens) instead of uniform.
      chunk: new tokens of the chunked / mixed prefill chunk.
      presets: presets to time (None: `MAIN_PRESETS`).
      graph: also time the torch call replayed in a CUDA graph (small shapes).
    """

    op: str
    geometry: Geometry
    batch: int
    ctx: int
    page: int = 16
    q_len: int = 1
    window: Optional[int] = None
    skew: bool = False
    chunk: int = 1024
    role: str = ""
    presets: Optional[tuple[str, ...]] = None
    graph: bool = False

    @property
    def id(self) -> str:
        g = self.geometry
        parts = [self.op, g.name, f"b{self.batch}", _k(self.ctx), f"p{self.page}"]
        if self.op == "multi":
            parts.append(f"q{self.q_len}")
        if self.op in ("chunked", "mixed"):
            parts.append(f"c{_k(self.chunk)}")
        if self.window:
            parts.append(f"w{_k(self.window)}")
        if self.skew:
            parts.append("skew")
        return "-".join(parts)

    @property
    def tokens(self) -> int:
        """B * ctx: the figure the goals' "B·ctx" refers to."""
        return self.batch * self.ctx

    def preset_list(self, only: Optional[tuple[str, ...]] = None) -> tuple[str, ...]:
        ps = self.presets or MAIN_PRESETS
        return tuple(p for p in ps if only is None or p in only)

    def seqs(self) -> list[tuple[int, int]]:
        """(seq_len, q_len) per sequence; store rows: (tokens, tokens) per sequence."""
        b, c = self.batch, self.ctx
        if self.op in ("decode", "multi"):
            q = 1 if self.op == "decode" else self.q_len
            if not self.skew or b == 1:
                return [(c, q)] * b
            # Linear spread ctx/4 .. 7ctx/4: one batch mixes short and long contexts.
            return [(max(q, int(c * (0.25 + 1.5 * i / (b - 1)))), q) for i in range(b)]
        if self.op == "prefill":
            return [(c, c)] * b
        if self.op == "chunked":
            return [(c + self.chunk, self.chunk)] * b
        if self.op == "mixed":
            return [(c, 1)] * (b - 1) + [(c, self.chunk)]
        if self.op == "store":
            return [(c, c)] * b
        raise ValueError(f"op: expected one of {OPS}, got {self.op!r}")

    def groups(self) -> list[tuple[int, int, int]]:
        """(count, q_len, seq_len) of the uniform groups of sequences (one baseline call each)."""
        out: dict[tuple[int, int], int] = {}
        for s, q in self.seqs():
            out[(q, s)] = out.get((q, s), 0) + 1
        return [(n, q, s) for (q, s), n in out.items()]

    def memory_bytes(self, presets) -> int:
        """Device bytes this row needs at once: the largest cache (25% spare pages, as
        `paged_batch` allocates), K/V in bf16 for the baselines in torch's and jax's
        layouts, query and output."""
        g = self.geometry
        tokens = sum(s for s, _ in self.seqs())
        pages = sum(-(-s // self.page) for s, _ in self.seqs())
        pages += max(2, pages // 4)
        slot = max(tq_spec.layout(p, g.head_dim).slot_bytes for p in presets) if presets else 0
        cache = pages * self.page * g.num_kv_heads * slot
        raw = tokens * g.num_kv_heads * g.head_dim * 2 * 2
        q_rows = sum(q for _, q in self.seqs())
        q = q_rows * g.num_q_heads * g.head_dim * 2 * 2
        return cache + 2 * raw + q


def quick_rows() -> list[BenchRow]:
    """The rows that decide the goals: one shape per goal (and one per remaining op), 19 row x preset
    configurations per leg (38 timings, 33 jax compiles with the jax-dpa baselines)."""
    L, one = LLAMA3_8B, (HEADLINE,)
    G = GEOMETRIES
    return [
        BenchRow("decode", L, 32, 8192, role="decode-base"),
        BenchRow("decode", G["d256-gqa4"], 32, 8192, role="decode-d256", presets=one),
        BenchRow("decode", G["gqa1-d128"], 32, 8192, role="decode-gqa1", presets=one),
        BenchRow("decode", G["gqa8-d128"], 32, 8192, role="decode-gqa8", presets=one),
        BenchRow("decode", L, 1, 4096, role="decode-b1", presets=one, graph=True),
        BenchRow("multi", L, 32, 8192, q_len=4, role="decode-q4", presets=one),
        BenchRow("prefill", L, 1, 8192, role="prefill", presets=one),
        BenchRow("prefill", L, 1, 8192, window=4096, role="prefill-window", presets=one),
        BenchRow("chunked", L, 1, 8192, chunk=1024, presets=one),
        BenchRow("mixed", L, 16, 8192, chunk=1024, presets=one),
        BenchRow("store", L, 1, 32768, role="store"),
    ]


def full_rows() -> list[BenchRow]:
    """Everything else: the B x ctx sweep per geometry, pages, windows, skew, q_len, chunks, stores."""
    L, G = LLAMA3_8B, GEOMETRIES
    rows: list[BenchRow] = []
    for geo in (L, G["gemma-hkv1"], G["gemma-hkv4"], G["d512"]):
        for b in (1, 4, 8, 32, 128):
            for ctx in (1024, 4096, 8192, 32768, 131072):
                rows.append(BenchRow("decode", geo, b, ctx, graph=b <= 4))
    for b, ctx in ((32, 8192), (8, 32768)):
        rows.append(BenchRow("decode", L, b, ctx, page=64))
        rows.append(BenchRow("decode", L, b, ctx, window=4096))
        rows.append(BenchRow("decode", L, b, ctx, skew=True))
    for q in (2, 8):
        rows.append(BenchRow("multi", L, 32, 8192, q_len=q))
    for ctx in (1024, 4096, 32768):
        rows.append(BenchRow("prefill", L, 1, ctx))
    rows.append(BenchRow("prefill", L, 1, 8192, page=64))
    rows.append(BenchRow("prefill", G["gemma-hkv4"], 1, 8192))
    rows.append(BenchRow("prefill", L, 1, 32768, window=4096))
    for prefix, chunk in ((32768, 1024), (8192, 512), (8192, 2048)):
        rows.append(BenchRow("chunked", L, 1, prefix, chunk=chunk))
    rows.append(BenchRow("mixed", L, 64, 4096, chunk=2048))
    for t in (4096, 131072):
        rows.append(BenchRow("store", L, 1, t))
    rows.append(BenchRow("store", G["gemma-hkv4"], 1, 32768))
    quick_ids = {r.id for r in quick_rows()}
    with_fp16 = [replace(r, presets=MAIN_PRESETS + ("fp16",)) if r.op == "decode" and r.presets is None
                 and r.batch == 32 and r.ctx == 8192 and r.geometry is L else r for r in rows]
    return [r for r in with_fp16 if r.id not in quick_ids]


def smoke_rows() -> list[BenchRow]:
    """Every op at tiny sizes for the CPU interpreters; the goal roles ride along so the
    goal table and every report path run (their numbers mean nothing on a CPU)."""
    S, two = GEOMETRIES["smoke"], (HEADLINE, "bf16")
    return [
        BenchRow("decode", S, 2, 40, role="decode-base", presets=two),
        BenchRow("decode", S, 1, 40, role="decode-b1", presets=(HEADLINE,), graph=True),
        BenchRow("multi", S, 2, 40, q_len=4, role="decode-q4", presets=two),
        BenchRow("prefill", S, 1, 40, role="prefill", presets=two),
        BenchRow("prefill", S, 1, 40, window=16, role="prefill-window", presets=two),
        BenchRow("chunked", S, 1, 24, chunk=16, presets=two),
        BenchRow("mixed", S, 3, 40, chunk=16, page=64, presets=("turboquant_k8v4", "bf16")),
        BenchRow("store", S, 1, 40, role="store", presets=two),
    ]


def select(rows, *, filters=(), ops=None) -> list[BenchRow]:
    """Rows whose id contains one of `filters` (all if none), restricted to `ops`."""
    out = []
    for r in rows:
        if ops and r.op not in ops:
            continue
        if filters and not any(f in r.id or f == r.role for f in filters):
            continue
        out.append(r)
    return out
