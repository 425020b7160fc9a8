"""Learned absolute position embeddings (GPT-2, OPT, GPT-J's ancestors): notes cannot move.

The position is added to the token embedding before the first layer, so every layer's keys
*and values* depend on it through all the non-linear layers below. No transformation of the
cached tensors turns notes written at position ``p`` into those written at ``p + d``. Prefill,
extend and decoding work as usual; shifting (and so splicing a skill at another offset) raises
:class:`~kvnotes.core.errors.PositionError` whose message says why and what to do instead.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvnotes.core.positions.base import PositionAdapter, register_adapter
from kvnotes.core.positions.rope import find_rotary_module

REASON = ("learned absolute position embeddings (added to the input embeddings) cannot be "
          "repositioned: every layer's keys and values depend on the absolute position through "
          "the whole network; prefill the text at its target position instead")


def _position_embedding(model: torch.nn.Module) -> str | None:
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Embedding) and (leaf == "wpe" or "position" in leaf):
            return name
    return None


def _has_learned_positions(model: torch.nn.Module) -> bool:
    return find_rotary_module(model) is None and _position_embedding(model) is not None


@register_adapter(_has_learned_positions)
class LearnedAbsoluteAdapter(PositionAdapter):
    """Learned absolute positions: notebooks work in place; moving them is unsupported."""

    name: ClassVar[str] = "learned_absolute"
    exact_shift = False
    approximate = False

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.embedding: str | None = _position_embedding(model)
        self.approximate_reason = REASON

    def describe(self) -> dict[str, object]:
        info = super().describe()
        info.update(position_embedding=self.embedding)
        return info
