"""Device inputs of one benchmark row: fresh random data, a permuted block table, caches.

Data is drawn with torch on the benchmark device (drawing gigabytes in numpy
would dominate the run) from a generator seeded by (seed, row id), and handed
to jax through DLPack without a copy. K/V live once, token-major
``[n, S, Hkv, D]`` per group of equal sequences: a view of it is the
contiguous K/V of the SDPA baseline (``[n, Hkv, S, D]`` strides, the layout
flash attention reads natively), its reshape ``[n*S, Hkv, D]`` is the input of
`store_kv`, and jax's `dot_product_attention` takes it as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..catalog.problem import PagedBatch, paged_batch
from ..catalog.sweeps import stable_seed
from .shapes import BenchRow

POISON_BYTE = 0xFF  # NaN in bf16/fp16 fields and in fp16 norms/scales: a read of an unwritten slot shows


@dataclass
class Group:
    """Sequences of one (q_len, seq_len): their indices and bf16 data.

    key, value: ``[n, S, Hkv, D]``; query: ``[n, q_len, Hq, D]`` (torch, on the device).
    """

    seq_ids: list[int]
    q_len: int
    seq_len: int
    key: object
    value: object
    query: object


@dataclass
class RowInputs:
    """Everything a row's calls read (torch tensors on `device`; `batch` stays numpy).

    query: ``bf16[T, Hq, D]`` (sequence b owns rows ``[qsl[b], qsl[b+1])``);
    block_table ``int32[B, W]``, seq_lens ``int32[B]``, query_start_loc ``int32[B+1]``.
    """

    row: BenchRow
    device: object
    batch: PagedBatch
    groups: list[Group]
    query: object
    block_table: object
    seq_lens: object
    query_start_loc: object
    seq_lens_np: np.ndarray
    qsl_np: np.ndarray
    jax_views: dict = field(default_factory=dict)

    def group_tokens(self, grp: Group):
        """(key, value ``bf16[n*S, Hkv, D]`` torch views, slots ``int64[n*S]`` numpy) of a group's tokens."""
        n, s = len(grp.seq_ids), grp.seq_len
        slots = np.concatenate([self.batch.slots[b] for b in grp.seq_ids])
        return grp.key.reshape(n * s, *grp.key.shape[2:]), grp.value.reshape(n * s, *grp.value.shape[2:]), slots

    def store_kv_inputs(self):
        """`group_tokens` of every group, concatenated: every token of every sequence, as a prefill stores."""
        import torch

        parts = [self.group_tokens(g) for g in self.groups]
        if len(parts) == 1:
            return parts[0]
        return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                np.concatenate([p[2] for p in parts]))

    def new_cache(self, slot_bytes: int):
        """``uint8[N, P, Hkv, slot_bytes]`` filled with poison (spare pages and unused slots stay so)."""
        import torch

        g = self.row.geometry
        return torch.full((self.batch.num_blocks, self.row.page, g.num_kv_heads, slot_bytes), POISON_BYTE,
                          dtype=torch.uint8, device=self.device)

    def jax(self, name: str, tensor=None):
        """A jax view of a torch tensor (DLPack, no copy), cached by name while the row lives."""
        if name not in self.jax_views:
            self.jax_views[name] = to_jax(getattr(self, name) if tensor is None else tensor)
        return self.jax_views[name]


def host(t) -> np.ndarray:
    """numpy copy of a torch tensor; bfloat16 stays bfloat16 (ml_dtypes), so dtype-driven bounds hold."""
    import ml_dtypes
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().copy().view(ml_dtypes.bfloat16)
    return t.numpy().copy()


def to_jax(t):
    """jax array sharing `t`'s memory (DLPack), or a copy through the host where DLPack refuses."""
    import jax
    import jax.dlpack

    try:
        return jax.dlpack.from_dlpack(t)
    except Exception:
        return jax.device_put(host(t))


def build_inputs(row: BenchRow, seed: int, device) -> RowInputs:
    """Fresh random inputs for `row` (standard normal bf16; never zeros)."""
    import torch

    g = row.geometry
    seqs = row.seqs()
    rng = np.random.default_rng(stable_seed("bench", seed, row.id))
    batch = paged_batch(seqs, row.page, rng=rng)
    gen = torch.Generator(device=device)
    gen.manual_seed(int(rng.integers(2**62)))

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)

    groups = []
    for n, q, s in row.groups():
        ids = [b for b, sq in enumerate(seqs) if sq == (s, q)]
        groups.append(Group(ids, q, s, randn(n, s, g.num_kv_heads, g.head_dim),
                            randn(n, s, g.num_kv_heads, g.head_dim), randn(n, q, g.num_q_heads, g.head_dim)))
    rows_of = {}
    for grp in groups:
        for i, b in enumerate(grp.seq_ids):
            rows_of[b] = grp.query[i]
    query = torch.cat([rows_of[b] for b in range(len(seqs))]) if row.op != "store" else None
    seq_lens = np.array([s for s, _ in seqs], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum([q for _, q in seqs])]).astype(np.int32)
    dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    return RowInputs(row, device, batch, groups, query, dev(batch.block_table), dev(seq_lens), dev(qsl),
                     seq_lens, qsl)
