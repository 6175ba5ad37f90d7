"""Launch-time facts shared by the launchers: interpreter detection, block sizes, layout codes."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

import tq_spec
from tq_spec import dispatch

# Integer codes the kernels branch on (constexpr), derived from tq_spec presets.
KEY_RAW, KEY_FP8, KEY_MSE = 0, 1, 2
VALUE_RAW, VALUE_UNIFORM = 0, 1
_KEY_CODES = {"raw": KEY_RAW, "fp8": KEY_FP8, "mse": KEY_MSE}
_VALUE_CODES = {"raw": VALUE_RAW, "uniform": VALUE_UNIFORM}

TORCH_TO_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _probe():
    pass


# `triton.jit` returns an InterpretedFunction when TRITON_INTERPRET=1 was set
# before this module was imported; that, not the current environment, decides
# how every kernel of this package runs.
KERNELS_INTERPRETED: bool = type(_probe).__name__ == "InterpretedFunction"


def interpreted(device: torch.device) -> bool:
    """True when the Triton kernels run in the interpreter (the CPU CI).

    The interpreter has known numeric bugs (bf16 rounding and dots, fp8 carry);
    kernels take this flag as a constexpr and route around them.
    """
    return KERNELS_INTERPRETED


def check_device(device: torch.device) -> None:
    """Raises NotImplementedError when no backend can run kernels on `device`."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and KERNELS_INTERPRETED:
        return
    hint = " (set TRITON_INTERPRET=1 before importing tq_torch to run on CPU)" if device.type == "cpu" else ""
    raise NotImplementedError(f"kv_cache: tq_torch kernels run on CUDA devices, got device {device}{hint}")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def padded_head_dim(head_dim: int) -> int:
    """Register-tile width for a head: next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, next_pow2(head_dim))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached; no sync)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def format_constexprs(layout: tq_spec.Layout) -> dict:
    """The slot format as kernel constexprs: field kinds, bit widths and byte offsets."""
    p = layout.preset
    raw_dtype = {"bfloat16": tl.bfloat16, "float16": tl.float16, None: tl.float16}[p.raw_dtype]
    return dict(
        D=layout.head_dim,
        KEY_FORMAT=_KEY_CODES[p.key_format],
        KEY_BITS=p.key_bits,
        NORM_CORRECTION=bool(p.norm_correction),
        KEY_NORM_OFF=layout.key_norm_offset if layout.key_norm_offset is not None else 0,
        VALUE_FORMAT=_VALUE_CODES[p.value_format],
        VALUE_BITS=p.value_bits,
        VALUE_OFF=layout.value_offset,
        VALUE_SCALE_OFF=layout.value_scale_offset if layout.value_scale_offset is not None else 0,
        VALUE_ZERO_OFF=layout.value_zero_offset if layout.value_zero_offset is not None else 0,
        RAW_DTYPE=raw_dtype,
    )


def field_bits_constexprs(fmt: dict) -> dict:
    """`format_constexprs` for the attention kernels: bits per stored K/V element.

    Raw elements are 16 bits, fp8 keys 8, codes their width; passed as
    constexprs because Triton 3.6 does not fold a jit helper's return value
    into a constexpr.
    """
    out = {k: v for k, v in fmt.items() if k not in ("KEY_BITS", "VALUE_BITS")}
    out["KEY_FIELD_BITS"] = {KEY_RAW: 16, KEY_FP8: 8}.get(fmt["KEY_FORMAT"], fmt["KEY_BITS"])
    out["VALUE_FIELD_BITS"] = 16 if fmt["VALUE_FORMAT"] == VALUE_RAW else fmt["VALUE_BITS"]
    return out


# --------------------------------------------------------------------------- tiles

# The interpreter runs every program in numpy: small tiles keep CPU tests fast
# and still exercise multi-tile loops, partial tiles and page crossings.
_INTERPRET_BLOCK_N = 16
_INTERPRET_EXTEND_BLOCK_M = 16
# Cap on the decode path's split partials (bytes), relevant only when the
# decode path is forced on a large prefill.
_PARTIALS_BUDGET = 256 << 20
_MAX_SPLITS = 64


# Tile settings per path and key format, chosen by measurement (H100, B=32 x
# 8k decode and an 8k prefill at D=128; see BENCHMARKS.md). Keys "mse4"/"mse3"
# are the codebook widths, "fp8" and "raw" the other key formats.
# `prefetch`: the hand-pipelined key loop (packed 2-byte words cannot go
# through Triton's cp.async pipeliner); raw 16-bit tiles instead take
# Triton's pipeliner with `num_stages`.
_TILES_D128 = {
    "decode": {
        # programs_per_sm: resident programs per SM (registers) x waves. 4-bit keys: 3 resident
        # programs of 4 warps (168 registers; the Triton 3.9 build spills nothing in the key loop
        # without the prefetch's registers) x 2 waves. H100, B=32 x 8k, one call, a b a b against 2
        # resident at 255 registers with the prefetch (us): 405 / 376 / 407 / 374, GQA 1 410 / 352 /
        # 410 / 359, GQA 8 222 / 206 / 222 / 207, q_len 4 414 / 388 / 411 / 389; B=1 x 4k graph
        # 14.5 -> 13.9. 32-key tiles at 128 registers and 4 resident were slower (419 against 402).
        # `tall`: what tiles of more than 16 rows (GQA groups over 16) take instead: under the cap
        # they spill (Triton 3.9, GQA 32: 480 bytes, 90 reloads per key tile).
        "mse4": dict(block_n=64, num_warps=4, num_stages=1, maxnreg=168, programs_per_sm=6, prefetch=False,
                     tall=dict(maxnreg=None, programs_per_sm=4, prefetch=True)),
        # One-warp programs: no cross-warp softmax reductions (barriers) per key tile. H100, B=32 x 8k,
        # same call: k8v4 624 -> 451 us, 3bit_nc 777 -> 668 us; 4-bit codes stay faster on 4 warps
        # (and these stay faster on one: steps.md, eleventh session). programs_per_sm 34 keeps their
        # 17 splits at B=32 x Hkv 8 (16 were 1-3 % slower, same call).
        "mse3": dict(block_n=16, num_warps=1, num_stages=1, maxnreg=None, programs_per_sm=34, prefetch=True),
        "fp8": dict(block_n=16, num_warps=1, num_stages=1, maxnreg=None, programs_per_sm=34, prefetch=True),
        # 2 resident assumed (three pipeline stages of K/V tiles in shared memory) x 2 waves: the 2
        # splits it had at B=32 x Hkv 8.
        "raw": dict(block_n=64, num_warps=4, num_stages=3, maxnreg=None, programs_per_sm=4, prefetch=False),
    },
    "extend": {
        "mse4": dict(block_n=32, extend_block_m=128, num_warps=8, num_stages=1, maxnreg=None, prefetch=True),
        "mse3": dict(block_n=32, extend_block_m=128, num_warps=8, num_stages=1, maxnreg=None, prefetch=True),
        "fp8": dict(block_n=32, extend_block_m=128, num_warps=8, num_stages=1, maxnreg=None, prefetch=True),
        # Raw keys (bf16/fp16 caches, and the dequant path's workspace) on 3 stages, as tq_jax's.
        # H100, 4bit_nc rows, one call, a b c a b c for 2 / 3 / 4 stages (ms): prefill 8k 2.434 /
        # 2.245 / 2.324 / 2.435 / 2.246 / 2.321, window 4k 1.935 / 1.796 / 1.851 / 1.935 / 1.799 /
        # 1.848, chunked 1k over 8k 0.734 / 0.682 / 0.694 / 0.733 / 0.683 / 0.695, mixed b16 1.271 /
        # 1.189 / 1.206 / 1.273 / 1.188 / 1.206 (128-key tiles: 8 % slower on 2 stages, 40 % on 3).
        "raw": dict(block_n=64, extend_block_m=128, num_warps=8, num_stages=3, maxnreg=None, prefetch=False),
    },
}
# `TUNING_OVERRIDES[path]` replaces any setting, for tuning runs only (then call
# `ops._attention_setup.cache_clear()`: launch settings are cached per format).
TUNING_OVERRIDES: dict = {"decode": {}, "extend": {}}


def key_kind(fmt: dict) -> str:
    """"mse4", "mse3", "fp8" or "raw": the key format as the tile table names it."""
    if fmt["KEY_FORMAT"] == KEY_MSE:
        return f"mse{fmt['KEY_BITS']}"
    return "fp8" if fmt["KEY_FORMAT"] == KEY_FP8 else "raw"


def attention_tiles(d_pad: int, interpret: bool, path: str = "extend", kind: str = "raw") -> dict:
    """Tile settings of a path: key-tile width, extend row-tile height, warps, stages, register cap.

    ``kind`` is `key_kind` of the preset. Head dims above 128 take 8 warps and
    smaller key tiles (registers), except 4-bit mse decode at D <= 256, measured
    fastest on 4 warps with the D <= 128 residency; other formats there are not tuned
    separately.
    """
    base = dict(extend_block_m=64, maxnreg=None, programs_per_sm=4, prefetch=True)
    if interpret:
        return dict(base, block_n=_INTERPRET_BLOCK_N, extend_block_m=_INTERPRET_EXTEND_BLOCK_M, num_warps=4,
                    num_stages=1)
    tiles = dict(base, **_TILES_D128[path][kind])
    if d_pad > 128:
        tiles.update(block_n=32 if d_pad <= 256 else 16, num_warps=8, maxnreg=None)
        if path == "extend":
            tiles["extend_block_m"] = 64 if d_pad <= 256 else 32
            if kind == "raw":
                tiles["num_stages"] = 2  # 3 stages measured at D <= 128 only
        elif kind == "mse4" and d_pad <= 256:
            # H100, D = 256 4bit_nc decode, B=32 x 8k, same call: 8 warps x 64-key tiles 0.495 ms
            # (Hq 16 / Hkv 4) and 0.967 ms (32 / 8); 4 warps x 32 keys 0.431 and 0.844 ms.
            # (At 8 warps, 64 keys had beaten 32: 0.77 against 1.02 ms.) The D = 128 residency
            # (168 registers, 3 programs x 2 waves, no hand prefetch) against 2 resident with the
            # prefetch, Hq 16 / Hkv 4, one call: 424 / 383 / 424 / 374 us; the prefetch dropped
            # alone 414. The Triton 3.9 build reloads 3-17 spilled words per key tile under the
            # cap and is still faster.
            tiles.update(block_n=32, num_warps=4)
            tiles["maxnreg"] = _TILES_D128[path][kind]["maxnreg"]
        elif kind == "mse4":
            # Not measured on heads over 256: the prefetch and the base count.
            tiles.update(programs_per_sm=base["programs_per_sm"], prefetch=True)
    tiles.update(TUNING_OVERRIDES.get(path, {}))
    return tiles


def decode_tiles(tiles: dict, group_size: int) -> dict:
    """The decode path's `attention_tiles` for GQA groups of ``group_size`` query heads: with the
    entry's ``tall`` settings when the tile (`decode_block_m`) is over 16 rows and its ``solo``
    settings when the group is one head (and without those keys; tq_jax's table uses ``solo``)."""
    out = {k: v for k, v in tiles.items() if k not in ("tall", "solo")}
    if decode_block_m(group_size) > 16:
        out.update(tiles.get("tall", {}))
    if group_size == 1:
        out.update(tiles.get("solo", {}))
    return out


def decode_block_m(group_size: int) -> int:
    """Rows of a decode tile (`tq_spec.dispatch.decode_tile_rows`, which the auto rule uses).

    The whole GQA group, padded to a power of two >= 16 (tl.dot minimum); the
    spare rows take the sequence's next query tokens.
    """
    return dispatch.decode_tile_rows(group_size)


def decode_num_splits(*, num_seqs: int, num_kv_heads: int, num_tokens: int, num_q_heads: int,
                      head_dim: int, max_context: int, block_n: int, device: torch.device,
                      interpret: bool, programs_per_sm: int = 4) -> int:
    """Splits of the decode path, from static shapes only (CUDA-graph safe).

    As many (seq, kv head, split) programs as fit in ``programs_per_sm`` per SM, without going
    over it: the tile table sets it to whole waves of resident programs, so the last wave is
    not a small fraction of one. At least two key tiles per split, and partial buffers kept
    under a fixed budget.

    Measured on an H100 (4bit_nc, against rounding up to 8 programs per SM): GQA 8, B=32 x 8k:
    4 splits 0.243 ms, 9 splits 0.262 ms; B=1 x 4k, CUDA graph: 32 splits 21.5 us, 64 splits 25.0 us.
    """
    max_tiles = max(1, -(-max_context // block_n))
    if interpret:
        want = 4  # exercises the merge, including empty splits on short sequences
    else:
        programs = max(1, num_seqs * num_kv_heads)
        want = programs_per_sm * sm_count(device) // programs
    splits = max(1, min(want, max_tiles // 2, _MAX_SPLITS))
    per_split = max(1, num_tokens * num_q_heads * (head_dim + 2) * 4)
    while splits > 1 and splits * per_split > _PARTIALS_BUDGET:
        splits //= 2
    return splits
