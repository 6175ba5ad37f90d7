"""Resolution of the data every kernel receives: rotation and codebook.

Kernels and the reference accept optional ``rotation=`` / ``codebook=``
arguments; `quant_params` turns them into concrete float32 arrays, so both
frameworks and the reference use the same numbers, generated once here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .codebook import Codebook, codebook as make_codebook
from .layout import Layout, layout as make_layout
from .presets import PresetLike, get_preset
from .rotation import rotation as make_rotation


@dataclass(frozen=True, eq=False)
class QuantParams:
    """Everything needed to encode/decode one (preset, head_dim).

    Attributes:
      layout: the slot layout.
      rotation: float32 ``[D, D]`` (``y = rotation @ u``) for mse presets, else None.
      codebook: the key `Codebook` for mse presets, else None.
    """

    layout: Layout
    rotation: np.ndarray | None = field(repr=False)
    codebook: Codebook | None = field(repr=False)

    @property
    def preset(self):
        return self.layout.preset

    @property
    def head_dim(self) -> int:
        return self.layout.head_dim


def quant_params(
    preset: PresetLike,
    head_dim: int,
    *,
    rotation: np.ndarray | None = None,
    codebook: Codebook | None = None,
) -> QuantParams:
    """Resolves the optional rotation/codebook for `preset` at `head_dim`.

    Args:
      rotation: None (the default Hadamard rotation) or an array-like
        ``[head_dim, head_dim]`` (e.g. ``tq_spec.rotation(D, "randomized_hadamard")``).
        Ignored-by-contract for non-mse presets: passing one there is an error.
      codebook: None (flavor ``"vllm"``) or a `Codebook` with the preset's key
        bits and this head_dim.

    Raises:
      ValueError / TypeError naming the argument on any mismatch.
    """
    p = get_preset(preset)
    lay = make_layout(p, head_dim)
    if p.key_format != "mse":
        if rotation is not None:
            raise ValueError(f"rotation: preset {p.name!r} does not rotate keys; pass rotation=None")
        if codebook is not None:
            raise ValueError(f"codebook: preset {p.name!r} has no key codebook; pass codebook=None")
        return QuantParams(lay, None, None)
    if rotation is None:
        rot = make_rotation(head_dim)
    else:
        rot = np.asarray(rotation)
        if rot.shape != (head_dim, head_dim):
            raise ValueError(
                f"rotation: expected shape ({head_dim}, {head_dim}), got {tuple(rot.shape)}"
            )
        if not np.issubdtype(rot.dtype, np.floating):
            raise TypeError(f"rotation: expected a float array, got dtype {rot.dtype}")
        rot = rot.astype(np.float32)
    if codebook is None:
        cb = make_codebook(head_dim, p.key_bits)
    else:
        if not isinstance(codebook, Codebook):
            raise TypeError(f"codebook: expected tq_spec.Codebook, got {type(codebook).__name__}")
        if codebook.bits != p.key_bits or codebook.head_dim != head_dim:
            raise ValueError(
                f"codebook: preset {p.name!r} at head_dim {head_dim} needs a {p.key_bits}-bit "
                f"codebook for head_dim {head_dim}, got bits={codebook.bits}, head_dim={codebook.head_dim}"
            )
        cb = codebook
    return QuantParams(lay, rot, cb)
