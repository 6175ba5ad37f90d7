"""Launch-time facts shared by the attention paths: tile settings per path and key kind,
decode row tiles and split counts (tq_torch's ``config``, for the Pallas kernels).

Everything here depends on static shapes only (no device data), so a jitted
step compiles once per shape and XLA command buffers / CUDA graphs stay valid.
"""

from __future__ import annotations

import jax

import tq_spec
from tq_spec import dispatch

from . import kernel_math as km

# Interpret mode runs every program on the CPU: small tiles keep the tests
# fast and still exercise multi-tile loops, partial tiles and page crossings.
_INTERPRET_TILES = dict(block_n=16, extend_block_m=16, num_warps=4, num_stages=1, prefetch=True,
                        programs_per_sm=4, max_registers=None)
# Cap on the decode path's float32 partials: a forced decode path on a long
# prefill gets fewer splits rather than gigabytes of partials.
_PARTIALS_BUDGET = 256 << 20
_MAX_SPLITS = 64
# SMs assumed when the lowering host has no GPU to ask (H100/H200: 132).
_DEFAULT_SM_COUNT = 132

# Tile settings per path and key kind at head_dim <= 128 (keys as tq_torch
# names them: "mse4"/"mse3" codebook widths, "fp8", "raw"). Starting points:
# tq_torch's H100 measurements, adjusted to what ptxas reports for these
# kernels (sm_90a, Triton 3.6): mse decode at 64 keys per tile needs 255
# registers and spills, at 32 it needs 215 (4-bit) / 237 (3-bit) and does
# not; fp8 decode at 16 keys needs 122. `max_registers` caps a kernel's
# registers (Triton's maxnreg, through `platform.pallas_kwargs`).
# Measured sweeps: docs/bench/steps.md.
# `prefetch`: the hand-pipelined key loop (bytes of tile i+1 in flight in the
# loop carry); raw 16-bit tiles (16-byte aligned slots) instead leave the
# loads to Triton's pipeliner with `num_stages` (cp.async).
_TILES_D128 = {
    "decode": {
        # mse keys without the hand prefetch (fewer registers live across the key loop). H100,
        # B=32 x 8k, one call, a b a b (us): 4bit_nc 518 / 503 / 519 / 498, k3v4_nc 560 / 516 /
        # 560 / 515, 3bit_nc 572 / 513 / 578 / 515, GQA 1 524 / 498 / 517 / 493, q_len 4 525 /
        # 507 / 529 / 508; fp8 keys keep it (489 / 494 / 484 / 493). Splits for 5 programs per SM
        # against 4, same protocol: GQA 8 273 / 254 / 271 / 255, the other rows within 2 %
        # (2 per SM: GQA 8 261, B=32 x 8k 602; 16 keys, 8 per SM 792; 64 keys x 8 warps 759;
        # 2 warps 713).
        # `max_registers` 128: 4 resident programs of 4 warps instead of 3 (139 registers uncapped;
        # the Triton 3.9 build spills 44 bytes at 4-bit keys, 8 at 3-bit). H100, B=32 x 8k 4bit_nc,
        # one call (us): uncapped at 5 per SM 494.8 / 492.8, capped at 4 per SM 496.8, 8 per SM
        # 472.4 / 469.7, 12 per SM 465.5; uncapped at 8 per SM 521.7; 112 registers at 8 per SM
        # 478.2, 96 at 10 per SM 495.2; 64 keys at 168 registers, 6 per SM 517.1 / 517.1. Capped at
        # 12 per SM against uncapped at 5, one call, a b a b: 4bit_nc 468 / 495 / 471 / 494, k3v4_nc
        # 493 / 511 / 500 / 515, 3bit_nc 478 / 526 / 480 / 512, GQA 8 246 / 261 / 248 / 263 (16 per
        # SM within 1 % of 12).
        # `tall`: tiles of more than 16 rows (GQA groups over 16; `decode_tiles`) keep the uncapped
        # setting.
        # 4-bit keys take the prefetch again since the split-KV loop's K/V loads are unmasked
        # (`kv_tiles.attend_key_range`): one call (us), B=32 x 8k 433 without / 406 with, GQA 8 230 / 221,
        # GQA 1 428 / 434; uncapped at 6 per SM 465 (3-bit keys not measured: they keep it off).
        # `solo`: groups of one query head (`decode_tiles`) spill more under the 128-register cap
        # (H100 ncu, B=32 x 8k 4bit_nc, GQA 1 against GQA 4: 4.0M local memory requests against
        # 0.34M, kernel 423 against 393 us). One call (us), GQA 1 / GQA 4: 168 registers at 4 per
        # SM 416 / 406 (a b a b against the 128-register entry: GQA 1 436 / 415 / 434 / 412, GQA 8
        # 218 / 222 / 227 / 232, so only groups of one take it), at 6 per SM 425 / 411, at 12 per
        # SM 433 / 412; uncapped at 5 per SM 488 / 436; without the prefetch 431 / 435.
        # `packed`: the decode whose MMA operands come from the packed key bytes (constant table
        # entries, batches of 8+ sequences: `attention._attend`), a loop without the prefetch that
        # spills nothing at 128 registers, groups of one head included. H100, one process, median
        # of 7 x 100 calls, two rounds (ms), B=32 x 8k 4bit_nc / GQA 1 / GQA 8: the entry above
        # (GQA 1 `solo`) 0.387 / 0.407 / 0.213; 16 per SM 0.379 / 0.406 / 0.203, with GQA 1 at 128
        # registers 0.380 / 0.381 / 0.203; 20 per SM 0.376 / 0.379 / 0.203; 24 per SM 0.377 /
        # 0.379 / 0.206; 32 per SM 0.374 / 0.378 / 0.214; 8 per SM 0.401 / 0.408 / 0.221; 64 keys
        # at 168 registers, 6 per SM 0.437 / 0.423 / 0.234; uncapped at 5 per SM 0.445 / 0.461 /
        # 0.240 (steps.md, session 29).
        "mse4": dict(block_n=32, num_warps=4, num_stages=1, programs_per_sm=12, prefetch=True, max_registers=128,
                     tall=dict(max_registers=None, programs_per_sm=5),
                     solo=dict(max_registers=168, programs_per_sm=4),
                     packed=dict(max_registers=128, programs_per_sm=20)),
        "mse3": dict(block_n=32, num_warps=4, num_stages=1, programs_per_sm=12, prefetch=False, max_registers=128,
                     tall=dict(max_registers=None, programs_per_sm=5)),
        # fp8 keys on 2 warps (tq_torch's run on one). H100, B=32 x 8k k8v4, one call (us): 4 warps
        # at 8 per SM 436, 2 warps at 16 per SM 355, 1 warp at 34 per SM 402 (32-key tiles 564);
        # 3-bit keys on 2 warps were slower (k3v4_nc 448 -> 489, 3bit_nc 472 -> 534). `tall` keeps
        # the 4-warp setting for groups over 16 (not measured on 2 warps).
        "fp8": dict(block_n=16, num_warps=2, num_stages=1, programs_per_sm=16, prefetch=True,
                    tall=dict(num_warps=4, programs_per_sm=8)),
        "raw": dict(block_n=64, num_warps=4, num_stages=3, programs_per_sm=2, prefetch=False),
    },
    "extend": {
        "mse4": dict(block_n=32, extend_block_m=128, num_warps=8, num_stages=1, prefetch=True),
        "mse3": dict(block_n=32, extend_block_m=128, num_warps=8, num_stages=1, prefetch=True),
        "fp8": dict(block_n=32, extend_block_m=128, num_warps=8, num_stages=1, prefetch=True),
        # Raw keys (bf16/fp16 caches, and the dequant path's workspace) on 3 stages. H100, one
        # call, jax rows (ms), 2 / 3 / 1 stages: chunked 1k over 8k 0.902 / 0.851 / 0.899, mixed
        # b16 1.513 / 1.443 / 1.547, prefill 8k 3.002 / 2.924 / 2.876, window 4k 2.518 / 2.481 /
        # 2.358 (a repeat within 1 %; 4 stages as 3; 32 keys: 8-22 % slower).
        # 64-row tiles on 4 warps: the 128-row tiles on 8 warps take 255 registers and spill
        # (H100 ncu, window 4k: 12.9M local memory requests, against 0.6M in tq_torch's kernel of
        # the same tiles). One call (ms), 128 x 8 / 64 x 4: prefill 8k 2.562 / 2.438, window 4k
        # 2.145 / 2.052 (128 rows on 4 warps: 3.883 / 2.952; 2 stages 2.560 / 2.136).
        "raw": dict(block_n=64, extend_block_m=64, num_warps=4, num_stages=3, prefetch=False),
    },
}
# `TUNING_OVERRIDES[path]` replaces any setting, for tuning runs only (then
# call `jax.clear_caches()`: the settings are baked into the jitted op).
TUNING_OVERRIDES: dict = {"decode": {}, "extend": {}}


def key_kind(preset) -> str:
    """"mse4", "mse3", "fp8" or "raw": the key format as the tile table names it."""
    p = tq_spec.get_preset(preset) if isinstance(preset, str) else preset
    if p.key_format == "mse":
        return f"mse{p.key_bits}"
    return "fp8" if p.key_format == "fp8" else "raw"


def padded_head_dim(head_dim: int) -> int:
    """Register-tile width for a head: next power of two, at least 32 (tl.dot's minimum is 16;
    32 keeps 3-bit planes (Dp / 8 groups) at >= 4 lanes)."""
    return max(32, km.next_pow2(head_dim))


def attention_tiles(d_pad: int, interpret: bool, path: str, kind: str) -> dict:
    """Tile settings: keys per tile, extend row-tile height, warps, stages, prefetch, programs per SM,
    register cap (``max_registers``); decode entries may carry ``tall``, ``solo`` and ``packed``
    (`decode_tiles`).

    Head dims above 128 keep smaller key tiles (registers), on 8 warps except 4-bit mse decode
    at D <= 256 (measured), with no register cap; other formats there are not tuned separately.
    """
    # `unmasked_tiles` (`kv_tiles.attend_key_range`): the extend path's three key loops; the
    # split-KV decode keeps one checked loop (measured faster there, see `attention_kernel`).
    if interpret:
        return dict(_INTERPRET_TILES, unmasked_tiles=path != "decode")
    tiles = dict(extend_block_m=64, programs_per_sm=4, max_registers=None, unmasked_tiles=path != "decode")
    tiles.update(_TILES_D128[path][kind])
    if d_pad > 128:
        tiles.update(block_n=32 if d_pad <= 256 else 16, num_warps=8, max_registers=None)
        tiles.pop("tall", None)
        tiles.pop("solo", None)
        tiles.pop("packed", None)
        if path == "decode" and kind in ("mse4", "mse3"):
            # mse decode keeps the prefetch and 4 programs per SM on wider heads (not measured
            # for 3-bit keys), except 4-bit keys at D <= 256 below. Without the prefetch D = 256
            # 4bit_nc took 573 us against 514 (same call as the D <= 128 entries).
            tiles.update(prefetch=True, programs_per_sm=4)
        if path == "decode" and kind == "fp8":
            # The D <= 128 entry's 16 per SM was measured on 2 warps; wider heads run on 8 and
            # keep the 8 per SM they had with 4.
            tiles["programs_per_sm"] = 8
        if path == "extend":
            tiles["extend_block_m"] = 64 if d_pad <= 256 else 32
            if kind == "raw":
                tiles["num_stages"] = 2  # 3 stages measured at D <= 128 only
        elif kind == "mse4" and d_pad <= 256:
            # H100, D = 256 4bit_nc decode, B=32 x 8k, GQA 4, same call: 8 warps x 32 keys
            # 662 / 664 us (224 registers: one program per SM), 4 warps x 32 keys 516 us (two per
            # SM, a fifth fewer warp instructions per key), 4 warps x 16 keys 590 us. tq_torch's
            # table picks 4 x 32 there too. Without the prefetch and with splits for 3 programs
            # per SM, one call, a b a b: 516 / 495 / 515 / 491 us (without the prefetch at 4
            # programs per SM: 573). Since the split-KV loop's K/V loads are unmasked
            # (`kv_tiles.attend_key_range`) the prefetch wins: one call, 3 per SM, 469 us without
            # it, 409 with it (without it at 4 per SM 571, at 2 per SM 634).
            tiles.update(num_warps=4, prefetch=True, programs_per_sm=3)
    tiles.update(TUNING_OVERRIDES.get(path, {}))
    return tiles


def decode_tiles(tiles: dict, group_size: int, packed: bool = False) -> dict:
    """The decode path's `attention_tiles` for GQA groups of ``group_size`` query heads: with the
    entry's ``tall`` settings when the tile (`decode_block_m`) is over 16 rows, else its ``solo``
    settings when the group is one head, then its ``packed`` settings for tiles read as packed
    operands (`kv_tiles.TileSpec.key_entries`, ``packed``); without those keys."""
    out = {k: v for k, v in tiles.items() if k not in ("tall", "solo", "packed")}
    if decode_block_m(group_size) > 16:
        out.update(tiles.get("tall", {}))
        return out
    if group_size == 1:
        out.update(tiles.get("solo", {}))
    if packed:
        out.update(tiles.get("packed", {}))
    return out


def decode_block_m(group_size: int) -> int:
    """Rows of a decode tile (`tq_spec.dispatch.decode_tile_rows`, which the auto rule uses).

    The whole GQA group, padded to a power of two >= 16 (dot minimum). The
    spare rows take the sequence's next query tokens, so a multi-token decode
    step (q_len 2-8) reads each K/V byte once per tile, not per token.
    """
    return dispatch.decode_tile_rows(group_size)


def sm_count() -> int:
    """SMs of the first GPU if this process has one, else `_DEFAULT_SM_COUNT` (static)."""
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        return _DEFAULT_SM_COUNT
    return int(getattr(dev, "core_count", 0) or _DEFAULT_SM_COUNT)


def gpu_compute_capability() -> int | None:
    """Compute capability (e.g. 90) of the first GPU of this process, None without one."""
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        return None
    try:
        return int(str(dev.compute_capability).replace(".", ""))
    except (AttributeError, ValueError):
        return None


def fp8_hardware_convert(interpret: bool) -> bool:
    """Whether kernels may convert fp8 e4m3fn bytes with a hardware cast.

    The Pallas Triton lowering casts from float8_e4m3fn only for compute
    capability >= 8.9 (it assumes 9.0 when no GPU is visible, as for an
    export); older GPUs decode the bytes with `kernel_math.fp8_e4m3fn_decode`.
    Interpret mode (XLA) always can.
    """
    if interpret:
        return True
    cc = gpu_compute_capability()
    return cc is None or cc >= 89


def decode_num_splits(*, num_seqs: int, num_kv_heads: int, num_tokens: int, num_q_heads: int, head_dim: int,
                      max_context: int, block_n: int, interpret: bool, programs_per_sm: int = 4) -> int:
    """Splits of the decode path, from static shapes only.

    Enough (sequence, kv head, split) programs to fill the GPU
    ``programs_per_sm`` times, no more splits than key tiles a sequence can
    have, and partial buffers kept under a fixed budget.
    """
    max_tiles = max(1, km.cdiv(max_context, block_n))
    if interpret:
        want = 4  # exercises the merge, including empty splits on short sequences
    else:
        want = km.cdiv(programs_per_sm * sm_count(), max(1, num_seqs * num_kv_heads))
    splits = max(1, min(want, max_tiles, _MAX_SPLITS))
    per_split = max(1, num_tokens * num_q_heads * (head_dim + 2) * 4)
    while splits > 1 and splits * per_split > _PARTIALS_BUDGET:
        splits //= 2
    return splits
