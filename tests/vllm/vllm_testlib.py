"""Drives the tq_torch vLLM backend through vLLM 0.33's real classes, the way vLLM's runner does.

* The kv-cache spec is vLLM's (``FullAttentionSpec`` / ``SlidingWindowSpec`` run
  through the backend's ``customize_spec``), and each layer's cache is the
  ``uint8[N, Hkv, P, slot]`` view that vLLM's ``create_kv_cache_views`` cuts
  out of one flat allocation in the backend's layout (LBNHC), two layers per
  allocation so the second one starts at a non-zero offset.
* ``CommonAttentionMetadata`` is built from a batch spec (sequence lengths,
  query lengths) like vLLM's ``tests/v1/attention`` do, with disjoint shuffled
  pages per request, plus optional full-CUDA-graph padding: requests with
  q_len 0 and seq_len 0, and token rows whose slot is -1.
* Queries, keys and values are strided views of one fused QKV projection, as
  ``Attention.forward`` hands them to the impl.
* A step is ``do_kv_cache_update`` then ``forward`` into a NaN-filled output;
  earlier steps' tokens (each request's context) are stored first.

The result is checked with the project's tolerances (`parity.tolerances`)
against the float64 reference on the same cache bytes.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import tq_spec
from parity.tolerances import check_attention, compare_store

VLLM_MISSING = "needs vllm==0.33 installed (pip install --no-deps 'vllm==0.33.*' plus its pure-Python imports; see .ci/run)"


def _vllm_has_compiled_extensions() -> bool:
    """False for vLLM's Python files alone (tests/vllm/gpu_carry.py), found without importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return any(f.startswith("_C") and f.endswith(".so") for d in locations if os.path.isdir(d)
               for f in os.listdir(d))


def import_vllm():
    """vLLM 0.33, or a skip with the reason (the platform must be chosen before vLLM is imported).

    vLLM's CUDA platform imports its compiled extensions (FlashAttention among
    them), which the Python-only copy that tests/vllm/gpu_carry.py brings to a
    GPU machine does not have; there vLLM runs on its CPU platform. Nothing
    tested here depends on vLLM's platform: our kernels and vLLM's Triton
    TurboQuant kernels run on the device of the tensors they are given.
    """
    if torch.cuda.is_available() and not _vllm_has_compiled_extensions():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        # vLLM's Triton wrappers (the peer kernels) then run in the Triton interpreter:
        # with no visible CUDA device vLLM keeps Triton enabled instead of disabling it.
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    try:
        import vllm
        from vllm.v1.attention.backends import turboquant_attn  # noqa: F401  (the real import chain)
    except ImportError as e:
        pytest.skip(f"{VLLM_MISSING}: {type(e).__name__}: {e}", allow_module_level=True)
    version = str(getattr(vllm, "__version__", "none"))
    if not version.startswith("0.33."):
        pytest.skip(f"needs vllm==0.33 installed, found {version}", allow_module_level=True)
    return vllm


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


TQ_PRESETS = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer's configuration (sizes kept tiny for the CPU interpreter)."""

    preset: str = "turboquant_4bit_nc"
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    window: int | None = None
    soft_cap: float | None = None
    sinks: bool = False
    scale: float | None = None
    dtype: torch.dtype = torch.bfloat16

    @property
    def layer_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_dim ** -0.5


class Harness:
    """The backend's classes for one layer spec, a vLLM config, a builder, an impl and a layer cache."""

    def __init__(self, spec: LayerSpec, *, num_blocks: int = 24, seed: int = 0, dev: torch.device | None = None):
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor, SlidingWindowSpec,
                                                create_kv_cache_views, get_kv_quant_mode)
        from vllm.v1.kv_cache_layout import KVCacheLayout

        from tq_torch.vllm.backend import TQTorchAttentionBackend

        self.spec = spec
        self.dev = dev or device()
        self.gen = torch.Generator().manual_seed(seed)
        self.backend = TQTorchAttentionBackend
        self.vllm_config = VllmConfig()
        common = dict(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_size=spec.head_dim,
                      dtype=torch.uint8, kv_quant_mode=get_kv_quant_mode(spec.preset))
        raw_spec = (SlidingWindowSpec(sliding_window=spec.window, **common) if spec.window
                    else FullAttentionSpec(**common))
        self.kv_spec = self.backend.customize_spec(raw_spec)
        layout = self.backend.supported_kv_cache_layouts()[0]
        assert layout == KVCacheLayout.LBNHC
        page = self.kv_spec.page_size_bytes
        self.num_blocks = num_blocks
        self.slot_bytes = tq_spec.layout(spec.preset, spec.head_dim).slot_bytes
        assert page == spec.block_size * spec.num_kv_heads * self.slot_bytes
        # Two layers in one allocation: ours is the second (non-zero storage offset). Canary bytes.
        self.raw = torch.full((2 * page * num_blocks,), 0xA5, dtype=torch.uint8, device=self.dev)
        tensor = KVCacheTensor(size=self.raw.numel(), layers=["model.layers.0.attn", "model.layers.1.attn"],
                               layer_stride=page * num_blocks, block_stride=page)
        self.views = create_kv_cache_views(self.raw, self.kv_spec, num_blocks, layout, tensor)
        self.kv_cache = self.views[1]  # [N, Hkv, P, slot], as the layer holds it
        assert tuple(self.kv_cache.shape) == (num_blocks, spec.num_kv_heads, spec.block_size, self.slot_bytes)
        self.sinks = ((torch.randn(spec.num_q_heads, generator=self.gen) * 2).to(self.dev, torch.bfloat16)
                      if spec.sinks else None)
        with set_current_vllm_config(self.vllm_config):
            self.builder = self.backend.get_builder_cls()(self.kv_spec, ["model.layers.1.attn"],
                                                          self.vllm_config, self.dev)
            extra = {"sinks": self.sinks} if self.sinks is not None else {}
            self.impl = self.backend.get_impl_cls()(
                spec.num_q_heads, spec.head_dim, spec.layer_scale, spec.num_kv_heads, None, spec.window,
                spec.preset, spec.soft_cap, "decoder", None, **extra)
        self.impl.process_weights_after_loading(spec.dtype)
        self.layer = torch.nn.Module()
        self.enum = AttentionBackendEnum
        self._pages: dict[int, list[int]] = {}
        self._free = torch.randperm(num_blocks, generator=self.gen).tolist()

    # -- cache as tq_torch sees it ------------------------------------------------------------------

    def tq_cache(self, layer: int = 1) -> torch.Tensor:
        """A layer's cache as ``[N, P, Hkv, slot]`` (a view: the bytes vLLM holds); ours is layer 1."""
        return self.views[layer].transpose(1, 2)

    def pages_for(self, req: int, seq_len: int) -> list[int]:
        """Request `req`'s block ids (allocated on demand, disjoint, shuffled)."""
        pages = self._pages.setdefault(req, [])
        while len(pages) * self.spec.block_size < seq_len:
            pages.append(self._free.pop())
        return pages

    def slots(self, req: int, positions) -> list[int]:
        pages = self.pages_for(req, max(positions) + 1 if len(positions) else 0)
        p = self.spec.block_size
        return [pages[t // p] * p + t % p for t in positions]

    # -- data ---------------------------------------------------------------------------------------

    def fused_qkv(self, num_tokens: int):
        """(query, key, value): ``[T, H, D]`` strided views of one ``[T, (Hq + 2 Hkv) D]`` projection."""
        s = self.spec
        d = s.head_dim
        qkv = torch.randn(num_tokens, (s.num_q_heads + 2 * s.num_kv_heads) * d, generator=self.gen)
        # Keys with varied norms, values with per-token offsets (like the tq_torch tests).
        qkv[:, s.num_q_heads * d:(s.num_q_heads + s.num_kv_heads) * d] *= 0.5 + 3 * torch.rand(num_tokens, 1, generator=self.gen)
        qkv[:, (s.num_q_heads + s.num_kv_heads) * d:] += torch.randn(num_tokens, 1, generator=self.gen)
        qkv = qkv.to(self.dev, s.dtype)
        q, k, v = qkv.split([s.num_q_heads * d, s.num_kv_heads * d, s.num_kv_heads * d], dim=-1)
        q = q.view(-1, s.num_q_heads, d)
        k = k.view(-1, s.num_kv_heads, d)
        v = v.view(-1, s.num_kv_heads, d)
        assert num_tokens < 2 or not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
        return q, k, v

    def store_context(self, seq_lens, query_lens, reqs=None) -> None:
        """Earlier steps: each request's tokens before its queries, through ``do_kv_cache_update``."""
        reqs = list(range(len(seq_lens))) if reqs is None else reqs
        slots = []
        for r, s, ql in zip(reqs, seq_lens, query_lens):
            slots += self.slots(r, list(range(s - ql)))
        if not slots:
            return
        _, k, v = self.fused_qkv(len(slots))
        sm = torch.tensor(slots, dtype=torch.int64, device=self.dev)
        self.impl.do_kv_cache_update(self.layer, k, v, self.kv_cache, sm)

    # -- metadata -----------------------------------------------------------------------------------

    def common_metadata(self, seq_lens, query_lens, *, reqs=None, pad_reqs: int = 0, pad_tokens: int = 0,
                        width: int | None = None):
        """vLLM's ``CommonAttentionMetadata`` for a batch (decodes first), optionally padded for a full graph.

        Padding requests have q_len 0, seq_len 0 and an all-zero block-table row;
        padding token rows have slot -1; ``num_actual_tokens`` counts them.
        """
        from vllm.v1.attention.backend import CommonAttentionMetadata

        reqs = list(range(len(seq_lens))) if reqs is None else reqs
        b = len(seq_lens) + pad_reqs
        qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
        qsl = np.concatenate([qsl, np.full(pad_reqs, qsl[-1], np.int32)])
        seq = np.array(list(seq_lens) + [0] * pad_reqs, np.int32)
        tables = [self.pages_for(r, s) for r, s in zip(reqs, seq_lens)]
        # One spare column at least, as vLLM's tables are wider than the batch needs.
        width = width or max([len(t) for t in tables] + [1]) + 1
        bt = np.zeros((b, width), np.int32)
        for i, t in enumerate(tables):
            bt[i, :len(t)] = t
        slots = []
        for r, s, ql in zip(reqs, seq_lens, query_lens):
            slots += self.slots(r, list(range(s - ql, s)))
        slots += [-1] * pad_tokens
        num_tokens = int(qsl[-1]) + pad_tokens
        on = lambda a, dt: torch.as_tensor(a, dtype=dt).to(self.dev)  # noqa: E731
        return CommonAttentionMetadata(
            query_start_loc=on(qsl, torch.int32), query_start_loc_cpu=torch.as_tensor(qsl),
            seq_lens=on(seq, torch.int32), num_reqs=b, num_actual_tokens=num_tokens,
            max_query_len=int(max(query_lens)), max_seq_len=int(max(seq_lens)),
            block_table_tensor=on(bt, torch.int32), slot_mapping=on(np.array(slots, np.int64), torch.int64),
            seq_lens_cpu_upper_bound=torch.as_tensor(seq))

    # -- one step -----------------------------------------------------------------------------------

    def step(self, cam, *, qkv=None, for_capture: bool = False):
        """Builder, ``do_kv_cache_update`` and ``forward`` like vLLM's runner; returns (query, output, metadata)."""
        s = self.spec
        t = cam.num_actual_tokens
        q, k, v = qkv if qkv is not None else self.fused_qkv(t)
        md = (self.builder.build_for_cudagraph_capture(cam) if for_capture
              else self.builder.build(common_prefix_len=0, common_attn_metadata=cam))
        self.impl.do_kv_cache_update(self.layer, k, v, self.kv_cache, cam.slot_mapping)
        out = torch.full((t, s.num_q_heads * s.head_dim), float("nan"), dtype=s.dtype, device=self.dev)
        got = self.impl.forward(self.layer, q, k, v, self.kv_cache, md, output=out.view(t, s.num_q_heads, s.head_dim))
        assert got.data_ptr() == out.data_ptr()
        return q, out.view(t, s.num_q_heads, s.head_dim), md

    def check(self, cam, query, out, *, expect_padding_zero: bool = True):
        """Asserts ``out`` is the reference on the same bytes (padding rows: exactly zero)."""
        s = self.spec
        assert not torch.isnan(out).any(), "output elements left unwritten (NaN poison survived)"
        n_real = int(cam.query_start_loc_cpu[-1])
        if expect_padding_zero and out.shape[0] > n_real:
            assert torch.count_nonzero(out[n_real:]) == 0, "padding rows must come back as zeros"
        sinks = None if self.sinks is None else self.sinks.float()
        cmp = check_attention(out, query, self.tq_cache(), cam.block_table_tensor, cam.seq_lens,
                              cam.query_start_loc, preset=s.preset, scale=s.layer_scale,
                              sliding_window=s.window, logits_soft_cap=s.soft_cap, sinks=sinks)
        assert cmp.ok, f"{s}: {cmp.describe()}"
        return cmp

    def check_store(self, before: torch.Tensor, key, value, slot_mapping) -> None:
        cmp = compare_store(self.tq_cache(), key, value, before, slot_mapping, preset=self.spec.preset)
        assert cmp.ok, cmp.describe()


class VllmPeer:
    """vLLM 0.33's own TurboQuant store and decode kernels, called as a peer (not copied).

    The rotation, centroids and midpoints are built with vLLM's own functions,
    as its backend does for each layer. On CPU the kernels run in the Triton
    interpreter, which vLLM allows only when it sees no CUDA device at all
    (`import_vllm` arranges that); otherwise the test is skipped.
    """

    def __init__(self, preset: str, head_dim: int, dev: torch.device):
        from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
        from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
        from vllm.triton_utils import HAS_TRITON
        from vllm.v1.attention.backends.turboquant_attn import _build_hadamard

        if not HAS_TRITON:
            pytest.skip("vLLM disabled its Triton kernels in this process (it found no usable Triton driver; on "
                        "CPU it needs CUDA_VISIBLE_DEVICES='' before vLLM is imported)")
        from vllm.v1.attention.ops.triton_turboquant_decode import triton_turboquant_decode_attention
        from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store

        self._store, self._decode = triton_turboquant_store, triton_turboquant_decode_attention
        self.cfg = TurboQuantConfig.from_cache_dtype(preset, head_dim)
        self.pi = _build_hadamard(head_dim, str(dev))
        self.pi_t = self.pi.T.contiguous()
        self.centroids = get_centroids(head_dim, self.cfg.centroid_bits).to(device=dev, dtype=torch.float32)
        c = self.centroids.sort().values
        self.midpoints = (c[:-1] + c[1:]) / 2

    def store(self, key, value, cache, slot_mapping) -> None:
        """vLLM's store into ``cache [N, P, Hkv, slot]``."""
        cfg = self.cfg
        self._store(key, value, cache, slot_mapping, self.pi_t, self.midpoints, mse_bits=cfg.key_mse_bits,
                    key_packed_size=cfg.key_packed_size, value_quant_bits=cfg.effective_value_quant_bits,
                    key_fp8=cfg.key_fp8)

    def decode(self, query, cache, block_table, seq_lens, scale: float, num_kv_splits: int) -> torch.Tensor:
        """vLLM's decode (one query per request, no window/cap/sinks) over ``cache [N, P, Hkv, slot]``."""
        cfg = self.cfg
        return self._decode(query.contiguous(), cache, block_table, seq_lens, self.pi, self.centroids, scale,
                            cfg.key_mse_bits, cfg.key_packed_size, cfg.effective_value_quant_bits,
                            key_fp8=cfg.key_fp8, norm_correction=cfg.norm_correction, PiT=self.pi_t,
                            max_num_kv_splits=num_kv_splits)
