"""Multimodal RoPE (Qwen2-VL, Qwen2.5-VL): three position axes (temporal, height, width) per token.

M-RoPE splits the rotary frequencies into three sections (``mrope_section``); frequency ``j``
of section ``s`` turns by ``axes[s] * inv_freq[j]``. Text tokens have three equal axes; image
tokens get ``(start, start + row, start + col)``. Moving a chunk of notes moves all three axes by
the same ``delta`` (that is how transformers places an image at another offset), so every
frequency turns by ``delta * inv_freq[j]``: exactly the 1-D re-rotation of :class:`RopeAdapter`.

Bookkeeping: ``nb.positions`` stays a LongTensor[n] holding, per token, the largest of its
height/width axes (equal to the plain position for text). Its last value plus one is where the
next text token goes, as in transformers' ``get_rope_index``; the per-token axis offsets are
shift-invariant, so no notebook operation needs the three axes themselves.
:func:`prefill_multimodal` prefills text with images at any start and returns such a notebook.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from kvnotes.core.errors import UnsupportedModelError
from kvnotes.core.positions.base import register_adapter
from kvnotes.core.positions.rope import RopeAdapter, find_rotary_module


def _has_mrope(model: torch.nn.Module) -> bool:
    rotary = find_rotary_module(model)
    return rotary is not None and getattr(rotary, "mrope_section", None) is not None


@register_adapter(_has_mrope, priority=10)
class MropeAdapter(RopeAdapter):
    """M-RoPE: a uniform shift of all three axes is the standard rotation (exact)."""

    name: ClassVar[str] = "mrope"

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        rotary: Any = find_rotary_module(model)  # transformers' M-RoPE module
        self.mrope_section: list[int] = list(rotary.mrope_section)

    def describe(self) -> dict[str, object]:
        info = super().describe()
        info.update(mrope_section=self.mrope_section, axes=["temporal", "height", "width"])
        return info


def mrope_axes(model: torch.nn.Module, input_ids: torch.Tensor, *,
               image_grid_thw: torch.Tensor | None = None,
               mm_token_type_ids: torch.Tensor | None = None, start: int = 0) -> torch.Tensor:
    """LongTensor[3, n]: the (temporal, height, width) position of each token, first at ``start``.

    ``input_ids`` is LongTensor[n]; image tokens are those equal to ``config.image_token_id``
    unless ``mm_token_type_ids`` (0 text, 1 image, 2 video) says otherwise.
    """
    inner: Any = getattr(model, "model", model)  # the VL model that has get_rope_index
    if not hasattr(inner, "get_rope_index"):
        raise UnsupportedModelError(f"{type(model).__name__} has no multimodal rope index")
    ids = input_ids.reshape(1, -1)
    if image_grid_thw is None:
        return torch.arange(start, start + ids.shape[1], device=ids.device).expand(3, -1).clone()
    if mm_token_type_ids is None:
        config: Any = model.config  # a transformers VL config (image_token_id)
        mm_token_type_ids = torch.eq(ids, config.image_token_id).int()
    axes, _ = inner.get_rope_index(ids, mm_token_type_ids=mm_token_type_ids.reshape(1, -1),
                                   image_grid_thw=image_grid_thw)
    return axes[:, 0, :].long() + start  # [3, n]
