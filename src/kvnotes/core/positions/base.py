"""The adapter interface and the registry that picks one from a model config."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, cast

import torch

from kvnotes.core.errors import PositionError, UnsupportedModelError

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def text_config(model: torch.nn.Module) -> PretrainedConfig:
    """The decoder's config of a transformers model (the text part of a multimodal one)."""
    # nn.Module types its attributes as Tensor | Module; a transformers model's is its config
    return cast("PretrainedConfig", model.config).get_text_config(decoder=True)


class PositionAdapter:
    """How one position scheme lays positions into the KV cache.

    Class flags say what the scheme allows:

    - ``supported``: notebooks can be built and fed back at all;
    - ``exact_shift``: :meth:`shift_layer` is exact up to float error;
    - ``approximate``: shifting works but is not exact (the reason is in ``approximate_reason``).
    """

    name: ClassVar[str] = "base"
    supported: ClassVar[bool] = True
    # instance-overridable: an adapter may find out from the config that shifting is approximate
    exact_shift: bool = False
    approximate: bool = False

    def __init__(self, model: torch.nn.Module) -> None:
        self.config = text_config(model)
        self.num_layers: int = self.config.num_hidden_layers
        self.max_positions: int | None = getattr(self.config, "max_position_embeddings", None)
        self.approximate_reason: str | None = None

    # ---- what the engine asks -------------------------------------------------------------
    def position_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """The ``position_ids`` tensor the model's forward takes for these 1-D positions."""
        return positions.unsqueeze(0)

    def check_positions(self, positions: torch.Tensor) -> None:
        """Refuse positions the model was not built for (negative or past its maximum)."""
        if positions.numel() == 0:
            return
        low, high = int(positions.min()), int(positions.max())
        if low < 0:
            raise PositionError(f"negative position {low}: notebooks start at position 0 or later")
        if self.max_positions is not None and high >= self.max_positions:
            raise PositionError(
                f"position {high} is past this model's maximum (max_position_embeddings="
                f"{self.max_positions}); use a shorter input or a smaller start/offset"
            )

    def shift_layer(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, delta: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(keys, values)`` of one layer as if every token sat ``delta`` positions later.

        ``delta`` is an int or a LongTensor[n] (one offset per token).
        """
        raise UnsupportedModelError(
            f"position scheme {self.name!r} cannot move cached tokens to other positions"
        )

    def shift_layer_into(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, delta: int,
        out_keys: torch.Tensor, out_values: torch.Tensor,
    ) -> None:
        """:meth:`shift_layer`, written into ``out_keys``/``out_values`` (a notebook's storage).

        Schemes that can rotate straight into the destination override this to skip the
        intermediate tensors.
        """
        keys, values = self.shift_layer(layer, keys, values, delta)
        out_keys.copy_(keys)
        out_values.copy_(values)

    def describe(self) -> dict[str, object]:
        """Machine-readable summary for ``kvnotes doctor`` and reports."""
        return {
            "scheme": self.name,
            "supported": self.supported,
            "exact_shift": self.exact_shift,
            "approximate": self.approximate,
            "reason": self.approximate_reason,
        }


# Registry: (priority, predicate over the model, adapter class), tried by descending priority,
# then registration order; first match wins.
_REGISTRY: list[tuple[int, Callable[[torch.nn.Module], bool], type[PositionAdapter]]] = []


def register_adapter(
    predicate: Callable[[torch.nn.Module], bool], *, priority: int = 0,
) -> Callable[[type[PositionAdapter]], type[PositionAdapter]]:
    """Class decorator: use this adapter for models where ``predicate(model)`` is true.

    A more specific scheme (MLA, M-RoPE, interleaved RoPE) registers with a higher ``priority``
    so it is tried before the generic one its models would also match.
    """

    def wrap(cls: type[PositionAdapter]) -> type[PositionAdapter]:
        _REGISTRY.append((priority, predicate, cls))
        _REGISTRY.sort(key=lambda entry: -entry[0])  # stable: ties keep registration order
        return cls

    return wrap


def adapter_for(model: torch.nn.Module) -> PositionAdapter:
    """Pick the position adapter for a loaded model from its config and rotary module."""
    for _, predicate, cls in _REGISTRY:
        if predicate(model):
            return cls(model)
    model_type = getattr(model.config, "model_type", type(model).__name__)
    known = ", ".join(sorted({cls.name for _, _, cls in _REGISTRY}))
    raise UnsupportedModelError(
        f"no position adapter for model_type {model_type!r} (known schemes: {known}); "
        "kvnotes needs a per-token attention KV cache with rotary positions"
    )
