"""Small cases shared by the runner tests: each class of defect must trip one of them, and
each runs in well under a second."""

from __future__ import annotations

from parity.catalog.cases import AttentionCase, LayerSpec, ModelCase

WINDOWED = AttentionCase("t", "turboquant_4bit_nc", 64, 4, 2, 4, ((13, 5), (9, 1), (4, 0)), sliding_window=3)
GQA = AttentionCase("t", "turboquant_k8v4", 64, 6, 2, 16, ((7, 2), (5, 1)))
CHUNKED = AttentionCase("t", "turboquant_3bit_nc", 64, 4, 2, 8, ((12, 9), (6, 3)), sliding_window=4,
                        checks=("chunking",), chunks=(1, 4, 128))
GPU_ONLY = AttentionCase("t", "bf16", 64, 2, 1, 16, ((3, 1),), far_pages=True, gpu_only=True)
MODEL = ModelCase("t", "tiny", (
    LayerSpec("A", "bf16", 64, 4, 2, 3),
    LayerSpec("B", "turboquant_k3v4_nc", 64, 4, 2, 2),
    LayerSpec("C", "turboquant_k3v4_nc", 64, 4, 2, 5, 20.0),
    LayerSpec("D", "turboquant_k3v4_nc", 64, 8, 2, None, reads_cache_of="B"),
), block_size=4, seqs=((9, 2), (5, 5)))
