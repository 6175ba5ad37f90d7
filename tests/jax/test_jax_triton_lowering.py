"""Lower every tq_jax kernel configuration to Triton IR for an abstract CUDA device.

Runs on the CPU-only jaxlib: ``jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))``
with ``interpret=False`` drives the Pallas Triton lowering (compute capability
9.0 when no GPU is visible) without compiling or running anything. Every
emitted Triton module is also passed through the MLIR verifier. This catches
what interpret mode accepts but a GPU rejects: tiles whose element count is not
a power of two, primitives the Triton lowering lacks (gathers via `jnp.take`,
value slicing, scratch buffers), unsupported casts and dot shapes.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.triton import lowering as triton_lowering
from jax.experimental import pallas as pl

import tq_spec
from tq_jax._src.attention import paged_attention_call
from tq_jax._src.params import resolve
from tq_jax._src.store import store_kv_call

S = jax.ShapeDtypeStruct
_MLIR_TYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


@pytest.fixture
def triton_modules(monkeypatch):
    """Records (and verifies) every Triton module the lowering emits."""
    modules = []
    original = triton_lowering.lower_jaxpr_to_triton_module

    def verified(*args, **kwargs):
        result = original(*args, **kwargs)
        op = result.module.operation
        assert op.verify(), "Triton module failed MLIR verification"
        modules.append(op.get_asm())
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", verified)
    return modules


def _lower_for_cuda(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


_STORE_CONFIGS = (
    [("turboquant_k8v4", d, False) for d in (32, 40, 72, 128, 512)]
    + [(p, d, False) for p in ("turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
       for d in (64, 128, 256, 512)]
    + [("bf16", 40, False), ("fp16", 256, False)]
    + [(p, d, True) for p, d in (("turboquant_k8v4", 40), ("turboquant_3bit_nc", 128), ("bf16", 72))]
)


@pytest.mark.parametrize("preset,head_dim,word_view", _STORE_CONFIGS)
def test_store_kernel_lowers_to_triton(triton_modules, preset, head_dim, word_view):
    lay = tq_spec.layout(preset, head_dim)
    kp = resolve(preset, head_dim)
    t, h = 7, 3
    fn = functools.partial(store_kv_call, preset_name=preset, interpret=False, word_view=word_view)
    _lower_for_cuda(
        fn, S((t, h, head_dim), jnp.bfloat16), S((t, h, head_dim), jnp.bfloat16),
        S((5, 16, h, lay.slot_bytes), jnp.uint8), S((t,), jnp.int32),
        None if kp.rotation is None else S((head_dim, head_dim), jnp.float32),
        None if kp.midpoints is None else S((16,), jnp.float32),
    )
    assert len(triton_modules) == 1
    assert "tt.store" in triton_modules[0]
    if tq_spec.get_preset(preset).is_quantized:  # divisions are IEEE div.rn, not div.full
        assert "div.rn.f32" in triton_modules[0]


# (preset, head_dim, q heads, kv heads, page size, query dtype, window, soft cap, sinks, word view)
_ATTENTION_CONFIGS = [
    ("turboquant_k8v4", 40, 6, 2, 5, "bfloat16", None, None, False, False),
    ("turboquant_k8v4", 512, 8, 1, 16, "float16", 8, 30.0, True, False),
    ("turboquant_k8v4", 128, 28, 4, 48, "float32", None, None, False, True),
    ("turboquant_4bit_nc", 64, 14, 2, 16, "bfloat16", 3, None, True, False),
    ("turboquant_4bit_nc", 512, 64, 4, 128, "bfloat16", None, 50.0, False, False),
    ("turboquant_k3v4_nc", 128, 32, 8, 1, "float16", 1, None, False, True),
    ("turboquant_k3v4_nc", 256, 20, 1, 16, "bfloat16", None, None, True, False),
    ("turboquant_3bit_nc", 64, 3, 3, 7, "float32", 100, 30.0, True, False),
    ("turboquant_3bit_nc", 256, 16, 2, 16, "bfloat16", None, None, False, True),
    ("bf16", 72, 7, 1, 16, "bfloat16", None, None, False, False),
    ("bf16", 512, 4, 2, 32, "float32", 16, None, True, False),
    ("fp16", 128, 8, 8, 48, "float16", None, 30.0, False, True),
    ("fp16", 32, 2, 1, 1, "float16", 2, None, False, False),
]


@pytest.mark.parametrize("path", tq_spec.dispatch.PATH_NAMES)
@pytest.mark.parametrize("cfg", _ATTENTION_CONFIGS, ids=lambda c: f"{c[0]}-D{c[1]}-{c[2]}q{c[3]}kv-P{c[4]}")
def test_attention_kernels_lower_to_triton(triton_modules, cfg, path):
    preset, d, hq, hkv, page, q_dtype, window, cap, sinks, word_view = cfg
    lay = tq_spec.layout(preset, d)
    kp = resolve(preset, d)
    t, b, max_blocks, n = 9, 3, 6, 20
    reason = tq_spec.dispatch.PATHS[path].ineligible(tq_spec.dispatch.DispatchProblem(
        t, b, hq, hkv, d, page, preset, window, query_dtype=q_dtype, max_blocks=max_blocks))
    if reason is not None:
        pytest.skip(f"path {path!r} is not eligible here: {reason}")
    fn = functools.partial(
        paged_attention_call, preset_name=preset, scale=0.125, sliding_window=window, logits_soft_cap=cap,
        path=path, num_splits=None, interpret=False, word_view=word_view,
    )
    _lower_for_cuda(
        fn, S((t, hq, d), jnp.dtype(q_dtype)), S((n, page, hkv, lay.slot_bytes), jnp.uint8),
        S((b, max_blocks), jnp.int32), S((b,), jnp.int32), S((b + 1,), jnp.int32),
        S((hq,), jnp.float32) if sinks else None,
        None if kp.rotation is None else S((d, d), jnp.float32),
        None if kp.centroids is None else S((16,), jnp.float32),
    )
    if path == "dequant":
        # First the pages into the 16-bit workspace (float32 decode: no dots), then the extend tiles.
        assert len(triton_modules) == 3
        decode_pages = triton_modules.pop(0)
        assert decode_pages.startswith("module @tq_dequantize_pages"), decode_pages[:200]
        assert "tt.store" in decode_pages and "tt.dot" not in decode_pages
        assert f"!tt.ptr<{_MLIR_TYPE[q_dtype]}>" in decode_pages  # written in the query's dtype
    if path != "decode":
        # Last, the rows no sequence owns are zeroed in place (`extend.zero_padding_rows`).
        zero_rows = triton_modules.pop()
        assert zero_rows.startswith("module @tq_zero_padding_rows"), zero_rows[:200]
        assert "tt.store" in zero_rows and "tt.load" in zero_rows and "tt.dot" not in zero_rows
    assert len(triton_modules) == 1
    if path == "dequant":
        # The workspace reaches the attention kernel as 16-bit floats, not bytes or words: its
        # K/V tiles feed the dots straight from the pipelined copy (H100, 8k prefill 2.38 -> 2.08 ms).
        assert "!tt.ptr<i8>" not in triton_modules[0] and "!tt.ptr<i16>" not in triton_modules[0]
        assert f"!tt.ptr<{_MLIR_TYPE[q_dtype]}>" in triton_modules[0]
    dots = [line for line in triton_modules[0].splitlines() if "tt.dot" in line]
    # Per key tile: q @ k^T (mse keys: even and odd elements, the split dot) and p @ v. The dequant
    # path's attention kernel reads the raw 16-bit workspace.
    p = tq_spec.get_preset(preset)
    split = p.key_format == "mse" and path != "dequant"
    # 16-bit queries over norm-corrected mse keys add ||c||**2 as two float16 dots (ones @ squares
    # of the even and of the odd elements), on tensor cores instead of cross-lane row sums.
    norm_rows = 2 if split and p.norm_correction and q_dtype != "float32" else 0
    # Split-KV decode runs one key loop; the extend kernel three (window edge, tiles every row
    # sees, diagonal: `kv_tiles.attend_key_range`), each with its own dots.
    loops = 1 if path == "decode" else 3
    assert len(dots) == loops * ((3 if split else 2) + norm_rows), dots
    if q_dtype == "bfloat16" and norm_rows:
        f16 = [line for line in dots if "xf16> * tensor<" in line]
        assert len(f16) == 2 * loops, dots
        dots = [line for line in dots if line not in f16]
    for line in dots:
        # Operands in the query dtype, float32 accumulation. float32 queries
        # must get IEEE dots: Triton prints a non-default inputPrecision (tf32)
        # and elides the default (ieee).
        assert f"x{_MLIR_TYPE[q_dtype]}> * tensor<" in line, line
        assert "-> tensor<" in line and line.rstrip().endswith("xf32>"), line
        if q_dtype == "float32":
            assert "tf32" not in line, line
    # The softmax exponent is one PTX ex2.approx per element (`kernel_math.exp2`, log2-domain
    # scores): libdevice's expf is about ten instructions, and on an H100 with jax 0.11.2 jnp.exp2
    # measured slower still (8k prefill 2.94 -> 3.17 ms, against 2.75 ms with ex2.approx).
    # (Only the extend epilogue's per-row sink terms, outside the key loop, keep jnp.exp.)
    assert "ex2.approx.ftz.f32" in triton_modules[0], "softmax exponent is not ex2.approx"
    libdevice_exp = re.findall(r'symbol = "__nv_exp\w*"\} : \(tensor<([\dx]+)xf32>\)', triton_modules[0])
    assert all("x" not in shape for shape in libdevice_exp), libdevice_exp
    assert sinks or not libdevice_exp, libdevice_exp


def test_harness_rejects_a_non_power_of_two_tile(triton_modules):
    """Control: the same harness fails on a kernel the GPU would reject."""

    def kernel(x_ref, o_ref):
        o_ref[pl.ds(0, 12)] = x_ref[pl.ds(0, 12)] * 2.0

    def fn(x):
        from tq_jax._src.platform import pallas_kwargs

        return pl.pallas_call(kernel, out_shape=S((16,), jnp.float32), grid=(1,),
                              **pallas_kwargs(interpret=False, name="not_a_power_of_two", num_warps=1))(x)

    with pytest.raises(Exception, match="power of 2"):
        _lower_for_cuda(fn, S((16,), jnp.float32))


def _triton_compile(ttir: str, num_warps: int, num_stages: int):
    """Compiles a lowered module with the installed Triton for sm_90a; skips if that cannot run here."""
    import os
    import tempfile

    triton = pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "kernel.ttir")
            with open(path, "w") as f:
                f.write(ttir)
            return triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=num_warps, num_stages=num_stages))
    except Exception as e:  # no usable Triton/ptxas for sm_90a on this host
        pytest.skip(f"Triton cannot compile for sm_90a here: {type(e).__name__}: {str(e)[:200]}")


def _triton_ttgir(ttir: str, num_warps: int, num_stages: int) -> str:
    return _triton_compile(ttir, num_warps, num_stages).asm["ttgir"]


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
def test_decode_cache_loads_are_vectorized(triton_modules, preset):
    """The compiled decode kernel (Triton, sm_90a) reads each slot's code bytes with vector loads and a
    warp along one slot (issue 11: every 16-bit word used to be two 1-byte gathers, one per thread), and
    never moves a tile of pointers between layouts (a gathered centroid tile did: 64 KB of shared
    memory per key tile)."""
    from tq_jax._src import config

    d, hq, hkv = 128, 8, 2
    lay = tq_spec.layout(preset, d)
    kp = resolve(preset, d)
    fn = functools.partial(paged_attention_call, preset_name=preset, scale=0.125, sliding_window=None,
                           logits_soft_cap=None, path="decode", num_splits=None, interpret=False)
    _lower_for_cuda(
        fn, S((4, hq, d), jnp.bfloat16), S((40, 16, hkv, lay.slot_bytes), jnp.uint8), S((4, 10), jnp.int32),
        S((4,), jnp.int32), S((5,), jnp.int32), None,
        None if kp.rotation is None else S((d, d), jnp.float32),
        None if kp.centroids is None else S((16,), jnp.float32),
    )
    tiles = config.attention_tiles(128, False, "decode", config.key_kind(preset))
    ttgir = _triton_ttgir(triton_modules[0], tiles["num_warps"], tiles["num_stages"])
    layouts = dict(re.findall(r"^(#\w+) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\]", ttgir, re.M))
    byte_loads = re.findall(r"tt\.load [^:]*: tensor<(\d+)x(\d+)x!tt\.ptr<i8>, (#\w+)>", ttgir)
    wide = [(rows, cols, enc) for rows, cols, enc in byte_loads if int(cols) >= 16]
    assert wide, "no slot-field byte loads found"
    for rows, cols, enc in wide:
        per_thread = [int(x) for x in layouts[enc].split(",")]
        assert per_thread[-1] >= 2, f"tensor<{rows}x{cols}xi8> loaded {per_thread} per thread ({enc})"
    moved = [line for line in ttgir.splitlines() if "convert_layout" in line and "!tt.ptr<" in line]
    assert not moved, moved[:2]
    if tq_spec.get_preset(preset).key_format == "mse":
        # The centroid lookup is a warp shuffle from the lane holding the code's entry: the
        # entries must stay in the threads that computed them from %laneid. A layout conversion
        # between the two would move them to other lanes (wrong centroids, no error).
        lane = re.findall(r'"mov\.u32 \$0, %laneid;".*-> tensor<[^,]*, (#\w+)>', ttgir)
        shuffles = re.findall(r'"shfl\.sync\.idx[^"]*".* : tensor<[^,]*, (#\w+)>, tensor<[^,]*, (#\w+)> ->', ttgir)
        assert len(lane) == 1 and len(shuffles) == 2, (lane, shuffles)
        assert all(a == b == lane[0] for a, b in shuffles), (lane, shuffles)
        moved_ints = [line for line in ttgir.splitlines() if "convert_layout" in line and "xi32, #" in line]
        assert not moved_ints, moved_ints[:2]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_constant_key_entries_match_the_device_tables(dtype):
    """The host's constant shuffle-table entries are bit for bit `key_tables`' row 0, for every
    4-bit mse preset and head size the default codebook serves."""
    import numpy as np

    from tq_jax._src.kv_tiles import constant_key_entries, key_tables
    from tq_jax._src.params import _default_tables

    for preset in [p for p in tq_spec.PRESET_NAMES
                   if tq_spec.get_preset(p).key_format == "mse" and tq_spec.get_preset(p).key_bits == 4]:
        nc = tq_spec.get_preset(preset).norm_correction
        for d in (64, 128, 256, 512):
            centroids = _default_tables(preset, d)[0]
            device = np.asarray(key_tables(jnp.asarray(centroids), 4, dtype, nc))[0, :16].view(np.int32)
            assert constant_key_entries(centroids, 4, jnp.dtype(dtype).name, nc) == tuple(int(x) for x in device)


def test_decode_key_tiles_skip_shared_memory_with_constant_entries(triton_modules):
    """Decode of 4-bit mse keys with the default codebook (constant table entries, the public
    op's default for batches of `CONSTANT_ENTRY_MIN_SEQS` or more): Triton 3.9 for sm_90a converts
    the loaded key *bytes* to the MMA layout, and no decoded key or square tile goes through shared
    memory (`kv_tiles.TileSpec.key_entries`)."""
    from tq_jax._src import attention, config

    preset, d, hq, hkv, b = "turboquant_4bit_nc", 128, 8, 2, attention.CONSTANT_ENTRY_MIN_SEQS
    lay = tq_spec.layout(preset, d)
    entries = attention._default_key_entries(tq_spec.get_preset(preset), d, jnp.bfloat16, "decode", None, None,
                                             num_seqs=b)
    assert entries is not None
    fn = functools.partial(paged_attention_call, preset_name=preset, scale=0.125, sliding_window=None,
                           logits_soft_cap=None, path="decode", num_splits=None, interpret=False,
                           key_entries=entries)
    _lower_for_cuda(
        fn, S((b, hq, d), jnp.bfloat16), S((40, 16, hkv, lay.slot_bytes), jnp.uint8), S((b, 10), jnp.int32),
        S((b,), jnp.int32), S((b + 1,), jnp.int32), None, S((d, d), jnp.float32), S((16,), jnp.float32),
    )
    tiles = config.decode_tiles(config.attention_tiles(128, False, "decode", config.key_kind(preset)), hq // hkv,
                                packed=True)
    ttgir = _triton_ttgir(triton_modules[0], tiles["num_warps"], tiles["num_stages"])
    block_n = tiles["block_n"]
    decoded = re.findall(rf"ttg\.local_alloc [^\n]*tensor<{block_n}x64xf?b?f16", ttgir)
    assert not decoded, decoded
    assert re.search(rf"ttg\.convert_layout [^\n]*tensor<{block_n}x64xi8", ttgir), "the key bytes are not converted"


def test_constant_key_entries_only_where_they_win():
    """The public op's choice (`attention._default_key_entries`): decode of 4-bit mse keys with the
    default codebook, a 16-bit query and `CONSTANT_ENTRY_MIN_SEQS` sequences or more (fewer
    programs run faster with the prefetching loop); every other case reads the tables in the kernel."""
    from tq_jax._src import attention

    default = functools.partial(attention._default_key_entries, head_dim=128, rotation=None, codebook=None)
    many, few = attention.CONSTANT_ENTRY_MIN_SEQS, attention.CONSTANT_ENTRY_MIN_SEQS - 1
    p = tq_spec.get_preset("turboquant_4bit_nc")
    for dtype in (jnp.bfloat16, jnp.float16):
        assert default(p, query_dtype=dtype, path="decode", num_seqs=many) is not None
    assert default(p, query_dtype=jnp.bfloat16, path="decode", num_seqs=few) is None
    assert default(p, query_dtype=jnp.float32, path="decode", num_seqs=many) is None
    assert default(p, query_dtype=jnp.bfloat16, path="extend", num_seqs=many) is None
    for preset in ("turboquant_k3v4_nc", "turboquant_3bit_nc", "turboquant_k8v4", "bf16"):
        p = tq_spec.get_preset(preset)
        assert default(p, query_dtype=jnp.bfloat16, path="decode", num_seqs=many) is None
    codebook = tq_spec.quant_params(tq_spec.get_preset("turboquant_4bit_nc"), 128).codebook
    assert attention._default_key_entries(tq_spec.get_preset("turboquant_4bit_nc"), 128, jnp.bfloat16, "decode",
                                          None, codebook, num_seqs=many) is None


def test_packed_decode_tiles_take_their_own_settings():
    """`config.decode_tiles` for the packed-operand decode (`kv_tiles.TileSpec.key_entries`): the
    entry's ``packed`` cap and split count for tiles of 16 rows, groups of one head included (over
    their ``solo`` setting); tiles of 32 rows keep ``tall``; wider heads have no ``packed`` entry."""
    from tq_jax._src import config

    tiles = config.attention_tiles(128, False, "decode", "mse4")
    packed = tiles["packed"]
    assert packed["max_registers"] != tiles["solo"]["max_registers"]
    for group in (1, 4, 8, 16):
        got = config.decode_tiles(tiles, group, packed=True)
        assert {k: got[k] for k in packed} == packed, (group, got)
        assert not {"tall", "solo", "packed"} & set(got)
    assert config.decode_tiles(tiles, 1)["max_registers"] == tiles["solo"]["max_registers"]
    tall = config.decode_tiles(tiles, 32, packed=True)
    assert {k: tall[k] for k in tiles["tall"]} == tiles["tall"]
    assert "packed" not in config.attention_tiles(256, False, "decode", "mse4")


@pytest.mark.parametrize("hq,path,capped", [(8, "decode", True), (2, "decode", True), (64, "decode", False),
                                            (8, "extend", False)],
                         ids=["decode-16-rows", "decode-group-of-one", "decode-32-rows", "extend"])
def test_register_cap_reaches_the_compiled_kernel(triton_modules, hq, path, capped):
    """The default decode tiles of mse keys at D = 128 ask for 128 registers (`config._TILES_D128`):
    the Pallas module carries ``ttg.maxnreg`` (`platform.pallas_kwargs`) and Triton turns it into the
    PTX ``.maxnreg`` directive (groups of one head, ``solo``: their own cap). Tiles of 32 rows (GQA 32,
    ``tall``) and the extend kernel do not."""
    from tq_jax._src import config, platform

    assert platform.REGISTER_CAP_HOOKED, "the jax version lacks the lowering hook the register cap needs"
    preset, d, hkv = "turboquant_4bit_nc", 128, 2
    lay = tq_spec.layout(preset, d)
    kp = resolve(preset, d)
    fn = functools.partial(paged_attention_call, preset_name=preset, scale=0.125, sliding_window=None,
                           logits_soft_cap=None, path=path, num_splits=None, interpret=False)
    _lower_for_cuda(
        fn, S((4, hq, d), jnp.bfloat16), S((40, 16, hkv, lay.slot_bytes), jnp.uint8), S((4, 10), jnp.int32),
        S((4,), jnp.int32), S((5,), jnp.int32), None, S((d, d), jnp.float32), S((16,), jnp.float32),
    )
    module = triton_modules[0]  # the attention kernel (the extend path then zeros padding rows)
    assert len(triton_modules) == (1 if path == "decode" else 2)
    tiles = config.attention_tiles(128, False, path, config.key_kind(preset))
    if path == "decode":
        tiles = config.decode_tiles(tiles, hq // hkv)
    assert (tiles["max_registers"] is not None) == capped, tiles
    attrs = re.findall(r'"?ttg\.maxnreg"? = (\d+) : i32', module)
    assert attrs == ([str(tiles["max_registers"])] if capped else []), attrs
    ptx = _triton_compile(module, tiles["num_warps"], tiles["num_stages"]).asm["ptx"]
    assert re.findall(r"\.maxnreg (\d+)", ptx) == ([str(tiles["max_registers"])] if capped else []), \
        re.findall(r"\.maxnreg.*", ptx)
