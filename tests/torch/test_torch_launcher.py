"""`tq_torch._src.launcher.KernelSite`: kept compiled kernels give what Triton's own launch gives.

The interpreter (CPU) always takes Triton's path, so the keeping itself is tested on a GPU
(``pytest -m gpu``).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import tq_spec
import tq_torch
from tq_torch._src import launcher
from tq_torch._src.launcher import KernelSite

from tq_torch_testlib import device

@triton.jit
def _axpb_kernel(x_ptr, y_ptr, out_ptr, n, stride, alpha, BLOCK: tl.constexpr, SHIFT: tl.constexpr = 3):
    """``out[i] = alpha * x[i * stride] + y[i] + SHIFT + n`` for ``i < n``."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(x_ptr + i * stride, mask=ok, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + i, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, (alpha * x + y + SHIFT + n).to(out_ptr.dtype.element_ty), mask=ok)


def _launch(site, x, y, n, stride, alpha):
    out = torch.full((n,), float("nan"), dtype=y.dtype, device=y.device)
    site((-(-n // 32),), (x, y, out), (n, stride, alpha))
    return out


def _want(x, y, n, stride, alpha, shift=3):
    return (alpha * x[::stride][:n].float() + y.float() + shift + n).to(y.dtype)


def test_site_computes_what_the_kernel_computes():
    dev = device()
    site = KernelSite(_axpb_kernel, dict(BLOCK=32, num_warps=1))
    g = torch.Generator().manual_seed(0)
    for n, stride, alpha in ((37, 1, 0.5), (37, 1, 0.5), (16, 2, -2.0)):
        x = torch.randn(n * stride, generator=g).to(dev)
        y = torch.randn(n, generator=g).to(dev)
        assert torch.equal(_launch(site, x, y, n, stride, alpha), _want(x, y, n, stride, alpha))


@pytest.mark.gpu  # the interpreter keeps no kernels
def test_site_keeps_one_kernel_per_specialisation():
    dev = torch.device("cuda")
    site = KernelSite(_axpb_kernel, dict(BLOCK=32, SHIFT=5, num_warps=1))
    g = torch.Generator().manual_seed(1)
    calls = []
    # ints specialise on == 1 and % 16; dtypes change the signature; each call is checked
    for n, stride, alpha, dtype in ((37, 1, 0.5, torch.float32), (37, 1, 0.5, torch.float32),
                                    (37, 1, 1.5, torch.float32), (32, 1, 0.5, torch.float32),
                                    (33, 2, 0.5, torch.float32), (37, 1, 0.5, torch.float16)):
        x = torch.randn(n * stride, generator=g).to(dev, dtype)
        y = torch.randn(n, generator=g).to(dev, dtype)
        assert torch.equal(_launch(site, x, y, n, stride, alpha), _want(x, y, n, stride, alpha, shift=5))
        calls.append(len(site._kept))
    assert calls == [1, 1, 2, 3, 4, 5]
    # A tensor 4 bytes off 16-byte alignment takes Triton's path (which compiles without the
    # alignment hint) and keeps nothing.
    x = torch.randn(41, generator=g).to(dev)[1:]
    y = torch.randn(37, generator=g).to(dev)
    assert x.data_ptr() % 16 == 4
    assert torch.equal(_launch(site, x, y, 37, 1, 0.5), _want(x, y, 37, 1, 0.5, shift=5))
    assert len(site._kept) == 5


@pytest.mark.gpu
def test_kept_launches_call_launch_hooks():
    # Profilers (proton) hook launches through `triton.knobs`; kept launches must still call them.
    from triton import knobs

    dev = torch.device("cuda")
    site = KernelSite(_axpb_kernel, dict(BLOCK=32, num_warps=1))
    x, y = torch.randn(37, device=dev), torch.randn(37, device=dev)
    _launch(site, x, y, 37, 1, 0.5)  # compiles and keeps
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731 (a triton LazyDict)
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert torch.equal(_launch(site, x, y, 37, 1, 0.5), _want(x, y, 37, 1, 0.5))
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert seen == ["_axpb_kernel"]
    assert torch.equal(_launch(site, x, y, 37, 1, 0.5), _want(x, y, 37, 1, 0.5))
    assert seen == ["_axpb_kernel"] and len(site._kept) == 1


@pytest.mark.gpu  # the interpreter keeps no kernels
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
def test_kept_decode_kernels_match_triton_launches(preset, monkeypatch):
    # Repeated decode calls of one shape relaunch kept kernels; the outputs must be the
    # bits that Triton's own launches give for the same inputs.
    dev = torch.device("cuda")
    hq, hkv, d, page, ctx = 8, 2, 128, 16, 300
    g = torch.Generator().manual_seed(2)
    lay = tq_spec.layout(preset, d)
    blocks = -(-ctx // page)
    cache = torch.zeros(blocks, page, hkv, lay.slot_bytes, dtype=torch.uint8, device=dev)
    kv = torch.randn(2, ctx, hkv, d, generator=g).to(dev, torch.bfloat16)
    tq_torch.store_kv(kv[0], kv[1], cache, torch.arange(ctx, device=dev), preset=preset)
    table = torch.arange(blocks, dtype=torch.int32, device=dev)[None]
    lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    queries = [torch.randn(1, hq, d, generator=g).to(dev, torch.bfloat16) for _ in range(3)]
    kept = [tq_torch.paged_attention(q, cache, table, lens, qsl, preset=preset) for q in queries]
    monkeypatch.setattr(launcher, "DIRECT", False)
    fresh = [tq_torch.paged_attention(q, cache, table, lens, qsl, preset=preset) for q in queries]
    for a, b in zip(kept, fresh):
        assert not torch.isnan(a).any()
        assert torch.equal(a, b)
