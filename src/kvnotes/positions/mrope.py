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

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvnotes.errors import EmptyInputError, UnsupportedModelError
from kvnotes.positions.base import register_adapter
from kvnotes.positions.rope import RopeAdapter, find_rotary_module

if TYPE_CHECKING:
    from kvnotes.engine import Engine
    from kvnotes.notebook import Notebook


def _has_mrope(model: torch.nn.Module) -> bool:
    rotary = find_rotary_module(model)
    return rotary is not None and getattr(rotary, "mrope_section", None) is not None


@register_adapter(_has_mrope, priority=10)
class MropeAdapter(RopeAdapter):
    """M-RoPE: a uniform shift of all three axes is the standard rotation (exact)."""

    name: ClassVar[str] = "mrope"

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        rotary = find_rotary_module(model)
        self.mrope_section: list[int] = list(rotary.mrope_section)  # type: ignore[union-attr]

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
    inner = getattr(model, "model", model)
    if not hasattr(inner, "get_rope_index"):
        raise UnsupportedModelError(f"{type(model).__name__} has no multimodal rope index")
    ids = input_ids.reshape(1, -1)
    if image_grid_thw is None:
        return torch.arange(start, start + ids.shape[1]).expand(3, -1).clone()
    if mm_token_type_ids is None:
        mm_token_type_ids = (ids == model.config.image_token_id).int()
    axes, _ = inner.get_rope_index(ids, mm_token_type_ids=mm_token_type_ids.reshape(1, -1),
                                   image_grid_thw=image_grid_thw)
    return axes[:, 0, :].long() + start  # [3, n]


@torch.inference_mode()
def prefill_multimodal(engine: Engine, input_ids: torch.Tensor | list[int], *,
                       pixel_values: torch.Tensor | None = None,
                       image_grid_thw: torch.Tensor | None = None,
                       mm_token_type_ids: torch.Tensor | None = None,
                       start: int = 0, name: str = "text", kind: str = "text",
                       **model_inputs: Any) -> Notebook:
    """Prefill a token sequence that may hold image tokens, its first token at ``start``.

    ``input_ids`` must already contain the image placeholder tokens (as a processor writes
    them); ``pixel_values`` and ``image_grid_thw`` are the processor's outputs for the images.
    The returned notebook splices, shifts and composes like any other (see module docstring).

    Example:
        >>> nb = prefill_multimodal(engine, ids, pixel_values=px,  # doctest: +SKIP
        ...                         image_grid_thw=thw, start=5)
    """
    from kvnotes.notebook import LayerKV, Notebook, Span

    if not isinstance(engine.adapter, MropeAdapter):
        raise UnsupportedModelError(
            "prefill_multimodal needs an M-RoPE model; this engine's scheme is "
            f"{engine.adapter.name!r}"
        )
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)  # [n]
    if not ids.numel():
        raise EmptyInputError("prefill_multimodal needs at least one token")
    axes = mrope_axes(engine.model, ids, image_grid_thw=image_grid_thw,
                      mm_token_type_ids=mm_token_type_ids, start=start)  # [3, n]
    positions = axes[1:].amax(dim=0)  # [n]: where the next text token goes is positions[-1] + 1
    engine.adapter.check_positions(axes.reshape(-1))
    cache = engine.empty(start).to_cache()
    extra = dict(model_inputs)
    if pixel_values is not None:
        extra.update(pixel_values=pixel_values.to(engine.device, engine.dtype),
                     image_grid_thw=image_grid_thw)
    engine.model(input_ids=ids[None].to(engine.device),
                 position_ids=axes[:, None, :].to(engine.device),  # [3, 1, n]
                 cache=cache, use_cache=True, **extra)
    layers = tuple(LayerKV(layer.keys, layer.values) for layer in cache.layers)
    return Notebook(layers=layers, token_ids=ids, positions=positions,
                    spans=[Span(name, kind, 0, ids.numel())], adapter=engine.adapter,
                    fingerprint=engine.fingerprint, origin=start)
