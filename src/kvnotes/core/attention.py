"""The attention kernel kvnotes runs CPU models with: SDPA without copying grouped K/V.

transformers' ``sdpa`` implementation repeats each key/value head ``num_key_value_groups``
times (``repeat_kv``: a full copy of the layer's K and V) whenever a forward has both a mask
and more than one query token, because CUDA's fused kernels refuse grouped heads with a mask.
That is exactly kvnotes' hot path: a request (or a repaired span, an erratum) fed on top of a
long composed notebook. On CPU, ``scaled_dot_product_attention(..., enable_gqa=True)`` takes the
mask and the grouped heads as they are, so the copy (3x the layer's KV for SmolLM2, every layer,
every forward) is pure waste (measured figures: docs/results/areas/engine.md, "Attention on CPU").

:func:`use_grouped_sdpa` switches a model on CPU from ``sdpa`` to ``kvnotes_sdpa``; the result is
the same function of the same inputs (tests compare logits), only the copy is gone. Every
other case (no mask, one query, no grouping, position bias, softcap) goes to transformers'
own ``sdpa`` unchanged. GPU models keep plain ``sdpa``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.utils.import_utils import is_torch_greater_or_equal

if TYPE_CHECKING:
    from transformers import PreTrainedModel

NAME = "kvnotes_sdpa"


def grouped_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None,
                         dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs: Any
                         ) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; ``query`` is [b, heads, q, d], ``key`` and
    ``value`` [b, kv_heads, kv, d]; returns [b, q, heads, d]."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = (groups == 1 or attention_mask is None or query.shape[2] == 1
             or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
             or kwargs.get("output_attentions", False))
    if plain:  # transformers' own path copies nothing here (or has to, e.g. position bias)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        enable_gqa=True)  # [b, heads, q, d]; the mask carries causality
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, grouped_sdpa_forward)
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def use_grouped_sdpa(model: torch.nn.Module, device: torch.device) -> bool:
    """Run ``model`` (on ``device``) with :func:`grouped_sdpa_forward` when it would use
    ``sdpa`` on a CPU (with a torch whose SDPA takes ``enable_gqa``, 2.5 on); returns whether it
    switched."""
    if device.type != "cpu" or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    if not is_torch_greater_or_equal("2.5"):
        return False
    _register()
    cast("PreTrainedModel", model).set_attn_implementation(NAME)
    return True
