"""Prefill of token sequences that hold image tokens (M-RoPE models: Qwen2-VL, Qwen2.5-VL).

The returned notebook splices, shifts and composes like any other; see
:mod:`kvnotes.core.positions.mrope` for the position bookkeeping.
"""

from __future__ import annotations

from typing import Any

import torch

from kvnotes.core.engine import Engine
from kvnotes.core.errors import EmptyInputError, UnsupportedModelError
from kvnotes.core.notebook import Notebook, Span
from kvnotes.core.positions.mrope import MropeAdapter, mrope_axes


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
    extra = dict(model_inputs)
    if pixel_values is not None:
        extra.update(pixel_values=pixel_values.to(engine.device, engine.dtype),
                     image_grid_thw=image_grid_thw)
    return engine.forward(engine.empty(start), ids, spans=[Span(name, kind, 0, ids.numel())],
                          positions=positions, position_ids=axes[:, None, :],  # [3, 1, n]
                          **extra).notebook
