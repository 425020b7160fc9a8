"""ALiBi (BLOOM, MPT, Falcon with ``alibi=True``): keys carry no position; moving is bookkeeping.

ALiBi adds ``-slope * distance`` to attention scores instead of rotating keys; cached keys and
values are position-free and a prefill at any start writes the same tensors. Shifting a notebook
only changes ``positions``. The bias transformers builds counts distance in *cache slots*, so
it matches the notebook's positions whenever they are contiguous (as ``compose`` keeps them); a
notebook with gaps in its positions is read as if the gaps were closed.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvnotes.core.positions.base import PositionAdapter, register_adapter, text_config
from kvnotes.core.positions.rope import find_rotary_module


def _uses_alibi(model: torch.nn.Module) -> bool:
    if find_rotary_module(model) is not None:
        return False
    config = text_config(model)
    attn_config = getattr(config, "attn_config", None)
    if getattr(config, "alibi", False) or getattr(attn_config, "alibi", False):
        return True
    return any(hasattr(module, "build_alibi_tensor") for module in model.modules())


@register_adapter(_uses_alibi)
class AlibiAdapter(PositionAdapter):
    """Linear attention biases: shifting is exact and leaves every tensor as it is."""

    name: ClassVar[str] = "alibi"
    exact_shift = True
    shift_reason: ClassVar[str] = ("keys carry no position: shifting only renumbers positions "
                                   "(the bias counts cache slots, so keep positions contiguous)")

    def shift_layer(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, delta: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return keys, values

    def describe(self) -> dict[str, object]:
        info = super().describe()
        info.update(note=self.shift_reason)
        return info
