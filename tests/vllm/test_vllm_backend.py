"""The tq_torch vLLM 0.33 backend against vLLM's real classes (CPU: Triton interpreter; GPU: `-m gpu` sizes).

Skipped with "needs vllm==0.33 installed" when vLLM is absent (.ci/run installs it).
"""

from __future__ import annotations

import os
import sys
import tomllib

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import vllm_testlib as L  # noqa: E402

vllm = L.import_vllm()

import tq_spec  # noqa: E402
import tq_torch.vllm as tqv  # noqa: E402
from tq_torch.vllm.backend import (TQTorchAttentionBackend, TQTorchAttentionImpl,  # noqa: E402
                                   TQTorchMetadataBuilder)
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FEATURES = {
    "plain": {},
    "window": dict(window=8),
    "softcap": dict(soft_cap=5.0),
    "sinks": dict(sinks=True),
    "all": dict(window=8, soft_cap=5.0, sinks=True),
}


@pytest.fixture
def restore_registry():
    """Leaves ``AttentionBackendEnum.TURBOQUANT`` as the test found it."""
    was = AttentionBackendEnum.TURBOQUANT.is_overridden()
    path = AttentionBackendEnum.TURBOQUANT.get_path()
    yield
    AttentionBackendEnum.TURBOQUANT.clear_override()
    if was:
        from vllm.v1.attention.backends.registry import register_backend
        register_backend(AttentionBackendEnum.TURBOQUANT, path)


# ----------------------------------------------------------------------------------- registration


def test_register_makes_turboquant_ours(restore_registry, monkeypatch):
    monkeypatch.delenv(tqv.DISABLE_ENV, raising=False)
    AttentionBackendEnum.TURBOQUANT.clear_override()
    assert AttentionBackendEnum.TURBOQUANT.get_class() is TurboQuantAttentionBackend
    assert tqv.register() is True
    assert tqv.register() is True  # idempotent (vLLM loads plugins in every process, maybe twice)
    cls = AttentionBackendEnum.TURBOQUANT.get_class()
    assert cls is TQTorchAttentionBackend
    assert issubclass(cls, TurboQuantAttentionBackend)
    # The layer maps get_name() back to the enum member.
    assert AttentionBackendEnum[cls.get_name()] is AttentionBackendEnum.TURBOQUANT
    assert cls.get_impl_cls() is TQTorchAttentionImpl and cls.get_builder_cls() is TQTorchMetadataBuilder


def test_off_switch_keeps_stock_backend(restore_registry, monkeypatch):
    AttentionBackendEnum.TURBOQUANT.clear_override()
    monkeypatch.setenv(tqv.DISABLE_ENV, "1")
    assert tqv.register() is False
    assert AttentionBackendEnum.TURBOQUANT.get_class() is TurboQuantAttentionBackend


def test_entry_point_declared_and_loadable(restore_registry, monkeypatch):
    """pyproject declares the plugin; an installed project exposes it to vLLM's own plugin loader."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        proj = tomllib.load(f)["project"]
    assert proj["entry-points"]["vllm.general_plugins"] == {tqv.PLUGIN_NAME: "tq_torch.vllm:register"}
    assert any(r.replace(" ", "").startswith("vllm==0.33") for r in proj["optional-dependencies"]["vllm"])
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    plugins = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    if tqv.PLUGIN_NAME not in plugins:
        pytest.skip("the project's installed metadata has no vllm.general_plugins entry (pip install -e . first)")
    assert plugins[tqv.PLUGIN_NAME] is tqv.register
    monkeypatch.delenv(tqv.DISABLE_ENV, raising=False)
    AttentionBackendEnum.TURBOQUANT.clear_override()
    plugins[tqv.PLUGIN_NAME]()
    assert AttentionBackendEnum.TURBOQUANT.get_class() is TQTorchAttentionBackend


# ------------------------------------------------------------------------------------- validation


def _validate(backend, **over):
    kw = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="turboquant_4bit_nc", block_size=16,
              use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
              use_per_head_quant_scales=False, device_capability=DeviceCapability(9, 0), attn_type="decoder",
              has_sliding_window=False)
    kw.update(over)
    return backend.validate_configuration(**kw)


@pytest.mark.parametrize("preset", L.TQ_PRESETS)
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_validate_configuration_accepts_windows_and_sinks(preset, block_size):
    for dtype in (torch.bfloat16, torch.float16):
        for head_size in (64, 128, 256):
            assert _validate(TQTorchAttentionBackend, kv_cache_dtype=preset, block_size=block_size, dtype=dtype,
                             head_size=head_size, has_sink=True, has_sliding_window=True) == []
    # The gap this backend closes: vLLM's own TurboQuant backend rejects both.
    assert _validate(TurboQuantAttentionBackend, kv_cache_dtype=preset, block_size=block_size, has_sink=True,
                     has_sliding_window=True) == ["attention sinks not supported", "sliding window not supported"]


def test_validate_configuration_rejects_like_vllm():
    """What neither backend runs is refused with vLLM's own reasons, identical to the stock backend's."""
    cases = [dict(attn_type="encoder"), dict(attn_type="encoder_decoder"), dict(use_mla=True),
             dict(kv_cache_dtype="auto"), dict(kv_cache_dtype="fp8"), dict(block_size=8),
             dict(dtype=torch.float32), dict(use_sparse=True), dict(use_mm_prefix=True),
             dict(use_per_head_quant_scales=True)]
    for over in cases:
        ours = _validate(TQTorchAttentionBackend, **over)
        assert ours, f"{over} should be rejected"
        assert ours == _validate(TurboQuantAttentionBackend, **over), over


def test_spec_page_and_layout_are_vllms():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode
    assert TQTorchAttentionBackend.supported_kv_cache_layouts() == TurboQuantAttentionBackend.supported_kv_cache_layouts()
    assert (TQTorchAttentionBackend.get_supported_kernel_block_sizes()
            == TurboQuantAttentionBackend.get_supported_kernel_block_sizes())
    assert TQTorchAttentionBackend.supported_kv_cache_dtypes == list(L.TQ_PRESETS)
    for preset in L.TQ_PRESETS:
        for d in (64, 128, 256):
            spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=d, dtype=torch.uint8,
                                     kv_quant_mode=get_kv_quant_mode(preset))
            ours, stock = TQTorchAttentionBackend.customize_spec(spec), TurboQuantAttentionBackend.customize_spec(spec)
            assert ours == stock
            assert ours.state_content_size_bytes == tq_spec.layout(preset, d).slot_bytes
            assert ours.page_size_bytes == 16 * 8 * tq_spec.layout(preset, d).slot_bytes


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bits", [3, 4])
def test_vllm_rotation_and_codebook_are_tq_specs_defaults(d, bits):
    """Caches are interchangeable because vLLM's Hadamard and centroids are tq_spec's defaults, bit for bit."""
    from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
    from vllm.v1.attention.backends.turboquant_attn import _build_hadamard
    assert np.array_equal(_build_hadamard(d, "cpu").numpy(), tq_spec.rotation(d))
    assert np.array_equal(get_centroids(d, bits).float().numpy(), tq_spec.codebook(d, bits).centroids)


def test_impl_rejections():
    with pytest.raises(NotImplementedError, match="ALiBi"):
        TQTorchAttentionImpl(4, 64, 0.125, 2, [0.1] * 4, None, "turboquant_4bit_nc")
    for attn_type in ("encoder", "encoder_only", "encoder_decoder"):
        with pytest.raises(NotImplementedError, match="encoder/decoder cross-attention are not implemented"):
            TQTorchAttentionImpl(4, 64, 0.125, 2, None, None, "turboquant_4bit_nc", None, attn_type)
    with pytest.raises(ValueError, match="turboquant_4bit_nc"):
        TQTorchAttentionImpl(4, 96, 0.125, 2, None, None, "turboquant_4bit_nc")  # no Hadamard at D=96
    with pytest.raises(ValueError, match="sinks"):
        TQTorchAttentionImpl(4, 64, 0.125, 2, None, None, "turboquant_4bit_nc", sinks=torch.zeros(2))
    impl = TQTorchAttentionImpl(4, 64, 0.125, 2, None, 0, "turboquant_k8v4", 0.0)
    assert impl.sliding_window is None and impl.logits_soft_cap is None  # vLLM's "none" spellings
    assert impl.fused_output_quant_supported(object()) is False
    with pytest.raises(NotImplementedError, match="fused output quantization"):
        impl.forward(None, torch.zeros(1, 4, 64), None, None, torch.zeros(1, 2, 16, 100, dtype=torch.uint8),
                     None, torch.zeros(1, 256), output_scale=torch.ones(1))


def test_builder_is_graph_safe_and_keeps_vllms_buffers():
    h = L.Harness(L.LayerSpec())
    assert TQTorchMetadataBuilder.get_cudagraph_support(h.vllm_config, h.kv_spec) == AttentionCGSupport.UNIFORM_BATCH
    assert h.builder.reorder_batch_threshold == 1
    cam = h.common_metadata([33, 9, 24, 7], [1, 1, 8, 7])
    md = h.builder.build(0, cam)
    # Persistent buffers are referenced, never copied.
    assert md.query_start_loc is cam.query_start_loc and md.seq_lens is cam.seq_lens
    assert md.block_table is cam.block_table_tensor and md.slot_mapping is cam.slot_mapping
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens) == (2, 2, 2)
    assert md.prefill_query_start_loc.tolist() == [0, 8, 15]
    pure = h.builder.build(0, h.common_metadata([5, 6], [1, 1], reqs=[10, 11]))
    assert pure.prefill_query_start_loc is None and pure.num_prefills == 0


# -------------------------------------------------------------------------------------- attention


@pytest.mark.parametrize("preset", L.TQ_PRESETS)
@pytest.mark.parametrize("features", ["plain", "all"])
def test_mixed_batch_every_preset(preset, features):
    """Decode + decode + prefix-cached continuation + fresh prefill, in one step (vLLM's order)."""
    h = L.Harness(L.LayerSpec(preset=preset, **FEATURES[features]))
    seq, ql = [33, 9, 24, 7], [1, 1, 8, 7]
    h.store_context(seq, ql)
    cam = h.common_metadata(seq, ql)
    q, out, md = h.step(cam)
    assert md.num_decodes == 2 and md.num_prefills == 2
    h.check(cam, q, out)


@pytest.mark.parametrize("features", ["window", "softcap", "sinks"])
def test_mixed_batch_each_feature(features):
    h = L.Harness(L.LayerSpec(preset="turboquant_k3v4_nc", **FEATURES[features]))
    seq, ql = [40, 12, 21], [1, 9, 21]
    h.store_context(seq, ql)
    cam = h.common_metadata(seq, ql)
    q, out, _ = h.step(cam)
    h.check(cam, q, out)


@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_4bit_nc"])
def test_pure_decode(preset):
    h = L.Harness(L.LayerSpec(preset=preset, **FEATURES["all"]))
    seq, ql = [17, 40, 5, 1], [1, 1, 1, 1]
    h.store_context(seq, ql)
    cam = h.common_metadata(seq, ql)
    q, out, md = h.step(cam)
    assert md.num_prefills == 0
    h.check(cam, q, out)


@pytest.mark.parametrize("features", ["plain", "all"])
def test_chunked_prefill_matches_one_shot(features):
    """A 45-token prompt prefilled in chunks 16+16+13 next to a running decode, and in one shot.

    Every chunk attends to the earlier chunks through the cache (no raw-K/V
    path), so each chunk matches the reference and the chunked outputs equal the
    one-shot prefill's rows up to accumulation order.
    """
    spec = L.LayerSpec(preset="turboquant_4bit_nc", **FEATURES[features])
    prompt = 45
    chunked = L.Harness(spec, seed=1)
    one_shot = L.Harness(spec, seed=1)
    # The same prompt tokens for both: draw them once.
    q_all, k_all, v_all = chunked.fused_qkv(prompt)
    chunked.store_context([20], [1], reqs=[7])
    pieces, at, bound = [], 0, 0.0
    for n in (16, 16, 13):
        dq, dk, dv = chunked.fused_qkv(1)  # the decode request's new token rides along
        cam = chunked.common_metadata([20 + len(pieces), at + n], [1, n], reqs=[7, 0])
        qkv = tuple(torch.cat([a, b[at:at + n]]) for a, b in ((dq, q_all), (dk, k_all), (dv, v_all)))
        q, out, md = chunked.step(cam, qkv=qkv)
        assert md.num_decodes == 1 and md.num_prefills == 1
        bound = max(bound, chunked.check(cam, q, out).bound)
        pieces.append(out[1:])
        at += n
    cam = one_shot.common_metadata([prompt], [prompt], reqs=[0])
    q, out, _ = one_shot.step(cam, qkv=(q_all, k_all, v_all))
    bound += one_shot.check(cam, q, out).bound
    # Both are within their bound of the same float64 answer (same prompt, same cache bytes).
    diff = (torch.cat(pieces).float() - out.float()).abs().max().item()
    assert diff <= bound, f"chunked vs one-shot prefill differ by {diff} > {bound}"


def test_full_graph_padding_and_replay_on_persistent_buffers():
    """Full-CUDA-graph shape: padded requests (q_len 0, seq_len 0), slot -1 rows; metadata built once.

    Like a graph replay, the second batch is written into the same metadata
    tensors in place and ``forward`` runs with the metadata object built for the
    first: nothing in it may depend on the values of the first batch.
    """
    h = L.Harness(L.LayerSpec(preset="turboquant_3bit_nc", **FEATURES["all"]), num_blocks=32)
    seq, ql = [20, 3, 31], [1, 1, 1]
    h.store_context(seq, ql)
    cam = h.common_metadata(seq, ql, pad_reqs=5, pad_tokens=5, width=4)  # 8 requests, 8 rows: a captured size
    assert cam.slot_mapping[-5:].tolist() == [-1] * 5
    q, out, md = h.step(cam, for_capture=True)
    assert md.num_prefills == 0
    h.check(cam, q, out)
    # Replay: another batch (5 real requests, 3 padding) through the same tensors and metadata object.
    seq2 = [21, 4, 32, 9, 2]
    h.store_context(seq2[3:], [1, 1], reqs=[3, 4])
    cam2 = h.common_metadata(seq2, [1] * 5, pad_reqs=3, pad_tokens=3, width=4)
    for name in ("query_start_loc", "seq_lens", "slot_mapping", "block_table_tensor"):
        getattr(cam, name).copy_(getattr(cam2, name))
    canary_layer0 = h.raw[: h.raw.numel() // 2].clone()
    q2, k2, v2 = h.fused_qkv(8)
    before = h.tq_cache().clone()
    h.impl.do_kv_cache_update(h.layer, k2, v2, h.kv_cache, cam.slot_mapping)
    out2 = torch.full((8, 4, 64), float("nan"), dtype=torch.bfloat16, device=h.dev)
    h.impl.forward(h.layer, q2, k2, v2, h.kv_cache, md, output=out2)
    h.check(cam, q2, out2)
    # The store wrote exactly the 5 real slots (slot -1 skipped), from strided fused-QKV views.
    h.check_store(before, k2, v2, cam.slot_mapping)
    assert torch.equal(h.raw[: h.raw.numel() // 2], canary_layer0), "another layer's cache bytes changed"


def test_fused_qkv_store_bytes_and_canary():
    h = L.Harness(L.LayerSpec(preset="turboquant_k8v4"))
    seq, ql = [12, 30], [12, 5]
    h.store_context(seq, ql)
    cam = h.common_metadata(seq, ql)
    q, k, v = h.fused_qkv(cam.num_actual_tokens)
    before = h.tq_cache().clone()
    layer0 = h.raw[: h.raw.numel() // 2].clone()
    h.impl.do_kv_cache_update(h.layer, k, v, h.kv_cache, cam.slot_mapping)
    h.check_store(before, k, v, cam.slot_mapping)
    assert torch.equal(h.raw[: h.raw.numel() // 2], layer0)


def test_gqa_ratio_3_and_head_dim_128():
    h = L.Harness(L.LayerSpec(preset="turboquant_4bit_nc", num_q_heads=6, num_kv_heads=2, head_dim=128,
                              block_size=32, window=20, sinks=True, scale=0.1))
    seq, ql = [50, 70], [1, 6]
    h.store_context(seq, ql)
    cam = h.common_metadata(seq, ql)
    q, out, _ = h.step(cam)
    h.check(cam, q, out)


def test_layers_keep_their_own_settings():
    """Two layers (different window, cap, sinks, scale) in the same step: nothing is shared between them."""
    a = L.Harness(L.LayerSpec(window=4, soft_cap=3.0, sinks=True), seed=3)
    b = L.Harness(L.LayerSpec(scale=0.3), seed=3)
    seq, ql = [30, 12], [1, 4]
    for h in (a, b):
        h.store_context(seq, ql)
    cams = [h.common_metadata(seq, ql) for h in (a, b)]
    qkv = a.fused_qkv(cams[0].num_actual_tokens)
    outs = [h.step(c, qkv=qkv) for h, c in zip((a, b), cams)]
    for h, c, (q, out, _) in zip((a, b), cams, outs):
        h.check(c, q, out)
    assert not torch.equal(outs[0][1], outs[1][1])


def test_sinks_converted_once_after_weights_load():
    h = L.Harness(L.LayerSpec(sinks=True))
    s = h.impl._sinks_f32
    assert s is not None and s.dtype == torch.float32 and torch.equal(s, h.sinks.float())
    seq, ql = [10], [1]
    h.store_context(seq, ql)
    h.step(h.common_metadata(seq, ql))
    assert h.impl._sinks_f32 is s  # no conversion per call


def test_profile_run_and_unbound_cache_return_zeros():
    h = L.Harness(L.LayerSpec())
    out = torch.full((3, 256), float("nan"), dtype=torch.bfloat16)
    q = torch.randn(3, 4, 64, dtype=torch.bfloat16)
    assert h.impl.forward(h.layer, q, None, None, h.kv_cache, None, output=out) is out
    assert torch.count_nonzero(out) == 0
    out.fill_(float("nan"))
    h.impl.forward(h.layer, q, None, None, torch.tensor([]), object(), output=out)
    assert torch.count_nonzero(out) == 0
    h.impl.do_kv_cache_update(h.layer, q[:, :2], q[:, :2], torch.tensor([]), torch.zeros(3, dtype=torch.int64))
