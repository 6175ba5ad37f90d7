"""The vLLM 0.33 attention backend that runs tq_torch's kernels on vLLM's TurboQuant cache.

Classes (vLLM instantiates them; nothing here is global across layers or ranks):

* `TQTorchAttentionBackend`: subclasses vLLM's ``TurboQuantAttentionBackend``, so
  the cache spec (one packed K|V slot per token and kv head, ``slot_bytes`` equal
  to `tq_spec.layout`), page size, kv-cache layout (LBNHC), dtypes, presets and
  block sizes stay vLLM's. It declares sliding windows and attention sinks as
  supported; ALiBi, encoder/cross attention and fused output quantization are
  rejected with vLLM's usual messages.
* `TQTorchMetadataBuilder`: turns vLLM's ``CommonAttentionMetadata`` into
  `TQTorchMetadata` without copying the persistent metadata tensors and without
  a device sync (the decode/prefill split reads the CPU copies).
* `TQTorchAttentionImpl`: ``do_kv_cache_update`` is `tq_torch.store_kv`;
  ``forward`` is `tq_torch.paged_attention` over the varlen batch (the decodes
  vLLM reorders to the front, then the prefill chunks), written into vLLM's
  ``output``. Every key and value is read from the cache, so a prefill's answer
  does not depend on how it was chunked. Window, soft cap, scale and sinks are
  the layer's; rotation and codebook are vLLM's defaults (Hadamard, vLLM's
  Lloyd-Max centroids), so caches are interchangeable with the stock backend.

CUDA graphs: the builder reports ``UNIFORM_BATCH`` like the stock one. Every
Python decision in ``forward`` depends on shapes and on per-batch integers that
are the same for every batch a captured graph replays; padded requests (q_len 0,
seq_len 0) and padded slots (-1) are handled by the kernels (padding rows come
back as zeros, slot -1 is skipped).

Shapes: ``T`` tokens of the step, ``B`` requests, ``Hq``/``Hkv`` heads, ``D``
head size, ``N`` blocks, ``P`` block size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

import tq_spec
import tq_torch
from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

__all__ = ["TQTorchAttentionBackend", "TQTorchAttentionImpl", "TQTorchMetadata", "TQTorchMetadataBuilder"]


class TQTorchAttentionBackend(TurboQuantAttentionBackend):
    """vLLM's TurboQuant backend with tq_torch's kernels (windows, sinks and soft cap honoured).

    ``get_name()`` stays ``"TURBOQUANT"`` (the enum member it is registered
    under); spec customisation, layouts, block sizes, dtypes and kv-cache dtypes
    are inherited unchanged.
    """

    @staticmethod
    def get_impl_cls() -> type["TQTorchAttentionImpl"]:
        return TQTorchAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["TQTorchMetadataBuilder"]:
        return TQTorchMetadataBuilder

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True


@dataclass
class TQTorchMetadata(AttentionMetadata):
    """Per-step metadata, shared by every layer of a kv-cache group.

    The tensors are vLLM's persistent buffers (views, never copies), on the
    device: ``query_start_loc`` int32 ``[B + 1]``, ``seq_lens`` int32 ``[B]``,
    ``block_table`` int32 ``[B, max_blocks]``, ``slot_mapping`` int64 ``[T]``.
    Requests ``[0, num_decodes)`` are decodes (their tokens are rows
    ``[0, num_decode_tokens)``); the rest are prefills (chunks, continuations,
    fresh prompts). ``prefill_query_start_loc`` is ``query_start_loc[num_decodes:]
    - num_decode_tokens`` when the batch mixes both, else None.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    prefill_query_start_loc: Optional[torch.Tensor] = None


class TQTorchMetadataBuilder(AttentionMetadataBuilder[TQTorchMetadata]):
    """Builds `TQTorchMetadata`; decodes first (vLLM reorders the batch for it)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Speculative verification (q_len 1 + k) counts as a decode: the kernels
        # take any q_len, so uniform spec-decode batches can use full graphs.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TQTorchMetadata:
        cam = common_attn_metadata
        # Reads query_start_loc_cpu only: no device sync.
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            cam, decode_threshold=self.reorder_batch_threshold or 1)
        prefill_qsl = None
        if num_decodes and num_prefills:
            # Mixed batches never replay a full graph (UNIFORM_BATCH), so a fresh
            # device tensor per step is fine; it is shared by every layer.
            prefill_qsl = cam.query_start_loc[num_decodes:] - num_decode_tokens
        return TQTorchMetadata(
            query_start_loc=cam.query_start_loc,
            seq_lens=cam.seq_lens,
            block_table=cam.block_table_tensor,
            slot_mapping=cam.slot_mapping,
            num_actual_tokens=cam.num_actual_tokens,
            max_query_len=cam.max_query_len,
            max_seq_len=cam.max_seq_len,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_prefills=num_prefills,
            prefill_query_start_loc=prefill_qsl,
        )


def _check_slot_bytes(kv_cache_dtype: str, head_size: int, slot_bytes: int) -> None:
    """tq_spec's slot must be the one vLLM sizes its pages with, or the caches would not line up."""
    vllm_slot = TurboQuantConfig.from_cache_dtype(kv_cache_dtype, head_size).slot_size_aligned
    if vllm_slot != slot_bytes:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} at head_size {head_size}: vLLM sizes slots of {vllm_slot} "
            f"bytes but tq_spec's layout has {slot_bytes}; this vLLM's TurboQuant format is not the one "
            f"tq_torch implements (set TQ_VLLM_DISABLE=1 to use vLLM's own backend)")


class TQTorchAttentionImpl(AttentionImpl[TQTorchMetadata]):
    """One attention layer: store through `tq_torch.store_kv`, attend through `tq_torch.paged_attention`.

    Args (vLLM's ``AttentionImpl`` signature):
      num_heads, num_kv_heads: this rank's query / kv heads (``Hq % Hkv == 0``).
      head_size: ``D``; the ``*_nc`` presets need a power of two in [64, 512],
        ``turboquant_k8v4`` a multiple of 8 in [32, 512] (`tq_spec.layout`).
      scale: the layer's logit scale.
      sliding_window: None, or ``W >= 1`` (key ``j`` visible iff
        ``pos - W < j <= pos``, vLLM's and FlashAttention's convention).
      kv_cache_dtype: a ``turboquant_*`` preset name.
      logits_soft_cap: None or 0 (none), or ``cap > 0``.
      sinks: None, or a ``[num_heads]`` tensor (any float dtype); converted to
        float32 once, in `process_weights_after_loading`.
    """

    supports_quant_query_input: bool = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: Optional[int] = None,
                 alibi_slopes: Optional[list[float]] = None, sliding_window: Optional[int] = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: Optional[float] = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: Optional[str] = None,
                 sinks: Optional[torch.Tensor] = None, **kwargs) -> None:
        if alibi_slopes is not None:
            raise NotImplementedError("TQTorchAttentionImpl does not support ALiBi.")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                "Encoder self-attention and encoder/decoder cross-attention are not implemented for "
                "TQTorchAttentionImpl")
        self.num_heads = int(num_heads)
        self.head_size = int(head_size)
        self.scale = float(scale)
        self.num_kv_heads = int(num_kv_heads if num_kv_heads is not None else num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) is not divisible by num_kv_heads ({self.num_kv_heads})")
        self.kv_cache_dtype = kv_cache_dtype
        self.preset = tq_spec.get_preset(kv_cache_dtype)  # ValueError naming the preset
        self.layout = tq_spec.layout(self.preset, self.head_size)  # ValueError for an unsupported D
        _check_slot_bytes(kv_cache_dtype, self.head_size, self.layout.slot_bytes)
        # vLLM passes 0 / None for "no window" and "no cap"; the kernels take None.
        self.sliding_window = int(sliding_window) if sliding_window and sliding_window > 0 else None
        self.logits_soft_cap = float(logits_soft_cap) if logits_soft_cap else None
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        if sinks is not None and tuple(sinks.shape) != (self.num_heads,):
            raise ValueError(
                f"sinks: expected shape ({self.num_heads},) (one logit per query head of this rank), "
                f"got {tuple(sinks.shape)}")
        self.sinks = sinks
        self._sinks_f32: Optional[torch.Tensor] = None

    # -- weights ------------------------------------------------------------------------------------

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Converts the sinks to float32 once (the kernels' dtype), after the checkpoint is in."""
        if self.sinks is not None:
            self._sinks_f32 = self.sinks.detach().to(torch.float32).contiguous()

    def _sinks_for(self, device: torch.device) -> Optional[torch.Tensor]:
        if self.sinks is None:
            return None
        s = self._sinks_f32
        if s is None or s.device != device:
            # Only reached when vLLM did not call process_weights_after_loading
            # (direct use in tests); vLLM's own runs convert once, above.
            s = self._sinks_f32 = self.sinks.detach().to(device=device, dtype=torch.float32).contiguous()
        return s

    # -- cache --------------------------------------------------------------------------------------

    @staticmethod
    def _cache_view(kv_cache: torch.Tensor) -> Optional[torch.Tensor]:
        """vLLM's per-layer ``uint8[N, Hkv, P, slot]`` view as tq_torch's ``[N, P, Hkv, slot]`` (no copy).

        None for the empty placeholder a layer holds before vLLM binds its cache.
        """
        if kv_cache.dim() != 4 or kv_cache.numel() == 0:
            return None
        return kv_cache.transpose(1, 2)

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Quantises this step's keys/values into the layer's cache (in place).

        ``key``/``value``: ``[>= T, Hkv, D]`` (or ``[>= T, Hkv * D]``), possibly
        strided views of a fused QKV projection; ``slot_mapping``: int64 ``[T]``,
        ``-1`` for padded tokens (skipped).
        """
        n = slot_mapping.shape[0]
        cache = self._cache_view(kv_cache)
        if n == 0 or cache is None:
            return
        k = key[:n].view(n, self.num_kv_heads, self.head_size)
        v = value[:n].view(n, self.num_kv_heads, self.head_size)
        tq_torch.store_kv(k, v, cache, slot_mapping, preset=self.preset)

    # -- attention ----------------------------------------------------------------------------------

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Optional[TQTorchMetadata],
                output: Optional[torch.Tensor] = None, output_scale: Optional[torch.Tensor] = None,
                output_block_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention of this step's queries over the cache, written into ``output``.

        ``query``: ``[T, Hq, D]`` (or ``[T, Hq * D]``), possibly a strided view;
        ``output``: ``[T, Hq, D]`` or ``[T, Hq * D]``. Rows past the batch's
        last query (padding) are written as zeros. ``key``/``value`` are not
        read: `do_kv_cache_update` has already stored them.
        """
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not yet supported for TQTorchAttentionImpl")
        t = query.shape[0]
        if output is None:
            output = torch.empty(t, self.num_heads * self.head_size, dtype=query.dtype, device=query.device)
        cache = self._cache_view(kv_cache)
        if attn_metadata is None or cache is None or t == 0:
            # Profiling run (no metadata) or no cache bound yet.
            return output.fill_(0)
        q = query.view(t, self.num_heads, self.head_size)
        out = output.view(t, self.num_heads, self.head_size)
        direct = out.dtype == q.dtype
        target = out if direct else torch.empty_like(q, memory_format=torch.contiguous_format)
        md = attn_metadata
        nd, ndt = md.num_decodes, md.num_decode_tokens
        if md.prefill_query_start_loc is None:
            # Pure decode, or pure prefill: one call over the whole batch (and its padding rows).
            self._attend(q, cache, md.block_table, md.seq_lens, md.query_start_loc, target,
                         decode_only=md.num_prefills == 0)
        else:
            # Mixed: decodes (rows [0, ndt)) on the decode path, the prefill chunks after them.
            self._attend(q[:ndt], cache, md.block_table[:nd], md.seq_lens[:nd], md.query_start_loc[:nd + 1],
                         target[:ndt], decode_only=True)
            self._attend(q[ndt:], cache, md.block_table[nd:], md.seq_lens[nd:], md.prefill_query_start_loc,
                         target[ndt:], decode_only=False)
        if not direct:
            out.copy_(target)
        return output

    def _attend(self, q, cache, block_table, seq_lens, query_start_loc, out, *, decode_only: bool) -> None:
        if q.shape[0] == 0:
            return
        # Decodes (q_len <= 1, or 1 + k under speculative decoding) take the
        # split-KV decode kernel, also when padding makes T exceed B (the shape
        # rule alone would then pick "extend"); prefill chunks take the shape rule.
        tq_torch.paged_attention(
            q, cache, block_table, seq_lens, query_start_loc, preset=self.preset, scale=self.scale,
            sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap,
            sinks=self._sinks_for(q.device), path="decode" if decode_only else "auto", out=out)

    def fused_output_quant_supported(self, quant_key) -> bool:
        return False
