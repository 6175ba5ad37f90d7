"""docs/format.md states the byte layout as numbers; they must match `tq_spec.layout`.

The page is hand-written for users, so a layout change that forgets it would
silently leave wrong offsets in the documentation.
"""

from __future__ import annotations

import os
import re

import pytest

import tq_spec

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "format.md")


def _table_after(heading: str) -> list[list[str]]:
    """Body rows of the first Markdown table after the line starting with `heading`."""
    lines = open(DOC, encoding="utf-8").read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    rows, seen = [], False
    for line in lines[start + 1:]:
        if line.startswith("|"):
            seen = True
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif seen:
            break
    return rows[2:]  # skip the header and the |---| line


def _presets(cell: str) -> list[str]:
    return re.findall(r"`([\w]+)`", cell)


def test_slot_bytes_table():
    rows = _table_after("`slot_bytes` by head dim")
    covered = set()
    for row in rows:
        for name in _presets(row[0]):
            covered.add(name)
            for d, cell in zip((64, 128, 256), row[1:]):
                assert int(cell) == tq_spec.layout(name, d).slot_bytes, (name, d)
    assert covered == set(tq_spec.PRESET_NAMES)


def _span(cell: str):
    m = re.match(r"`\[(\d+), (\d+)\)`", cell)
    return None if m is None else (int(m.group(1)), int(m.group(2)))


@pytest.mark.parametrize("name", tq_spec.PRESET_NAMES)
def test_offsets_table_at_d128(name):
    rows = {n: row for row in _table_after("Byte offsets within a slot at `D = 128`") for n in _presets(row[0])}
    key, norm, value, scale, zero, slot = rows[name][1:]
    lay = tq_spec.layout(name, 128)
    assert _span(key) == (lay.key_offset, lay.key_offset + lay.key_bytes)
    assert _span(value) == (lay.value_offset, lay.value_offset + lay.value_bytes)
    for cell, off in ((norm, lay.key_norm_offset), (scale, lay.value_scale_offset), (zero, lay.value_zero_offset)):
        assert _span(cell) == (None if off is None else (off, off + 2)), cell
    assert int(slot) == lay.slot_bytes


def test_auto_rule_as_documented():
    # "path="auto" picks decode when T <= B * (R / G) [R = max(16, next pow2 >= G)]; else dequant
    # for a quantised preset when T >= 16 * B and dequant is eligible; else extend"
    text = open(DOC, encoding="utf-8").read()
    assert "picks `decode` when `T <= B * (R / G)`" in text and "`R = max(16, next power of two >= G)`" in text
    assert "`T >= 16 * B`" in text
    dispatch = tq_spec.dispatch
    # Hq 8 / Hkv 2: G = 4, R = 16, 4 queries per sequence share a decode tile.
    for t, b, preset, dtype, want in ((1, 1, "bf16", "bfloat16", "decode"), (4, 4, "bf16", "bfloat16", "decode"),
                                      (3, 4, "turboquant_4bit_nc", "bfloat16", "decode"),
                                      (16, 4, "turboquant_4bit_nc", "bfloat16", "decode"),
                                      (17, 4, "turboquant_4bit_nc", "bfloat16", "extend"),
                                      (64, 4, "turboquant_4bit_nc", "bfloat16", "dequant"),
                                      (64, 4, "turboquant_k8v4", "float16", "dequant"),
                                      (64, 4, "turboquant_4bit_nc", "float32", "extend"),
                                      (64, 4, "bf16", "bfloat16", "extend")):
        problem = dispatch.DispatchProblem(t, b, 8, 2, 128, 16, preset, query_dtype=dtype, max_blocks=8)
        assert dispatch.select_path(problem) == want, (t, b, preset, dtype)
    # The tile size, and so the threshold, follows the group: (Hq, Hkv) -> last T of decode at B = 2.
    for hq, hkv, last in ((8, 8, 32), (16, 8, 16), (32, 4, 4), (48, 4, 2), (32, 2, 2), (64, 4, 2), (64, 2, 2)):
        g = hq // hkv
        assert dispatch.decode_tile_rows(g) == max(16, 1 << (g - 1).bit_length())
        for t in (last, last + 1):
            problem = dispatch.DispatchProblem(t, 2, hq, hkv, 128, 16, "turboquant_4bit_nc")
            assert dispatch.select_path(problem) == ("decode" if t == last else "extend"), (hq, hkv, t)
    assert dispatch.PATH_NAMES == ("decode", "extend", "dequant")
    assert "1 GiB" in text and dispatch.DEQUANT_WORKSPACE_BYTES == 1 << 30
