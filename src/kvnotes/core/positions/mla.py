"""Multi-head Latent Attention (DeepSeek-V2/V3): only the small rotary key part carries positions.

In transformers 5.x an MLA layer caches two single-head tensors per token (see
``DeepseekV2Attention.forward`` / ``DeepseekV3Attention.forward``):

- key slot:   the compressed latent ``[1, 1, n, kv_lora_rank]`` (normed, position-free);
- value slot: the shared rotary key ``k_rot`` ``[1, 1, n, qk_rope_head_dim]``, post-RoPE.

Moving notes rotates the value slot and leaves the latent alone. Its pairing is read from the
rotary module: DeepSeek-V2 returns complex ``freqs_cis`` (adjacent pairs); DeepSeek-V3 returns
cos/sin and stores ``k_rot`` in the half-split layout (``rope_interleave`` de-interleaves on the
way in). YaRN's mscale was applied once at prefill and a rotation keeps it.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvnotes.core.positions.base import register_adapter, text_config
from kvnotes.core.positions.interleaved import rotary_layout, rotate_pairs
from kvnotes.core.positions.rope import RopeAdapter, find_rotary_module, rotate_keys


def _is_mla(model: torch.nn.Module) -> bool:
    config = text_config(model)
    return (getattr(config, "kv_lora_rank", None) is not None
            and getattr(config, "qk_rope_head_dim", None) is not None
            and find_rotary_module(model) is not None)


@register_adapter(_is_mla, priority=20)
class MlaAdapter(RopeAdapter):
    """DeepSeek MLA: re-rotate the rotary key held in the value slot; the latent never moves."""

    name: ClassVar[str] = "mla"

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        rotary = find_rotary_module(model)
        assert rotary is not None
        self.kv_lora_rank: int = int(self.config.kv_lora_rank)
        self.rope_dim: int = int(self.config.qk_rope_head_dim)
        self.layout = rotary_layout(rotary) or "half"
        rot = 2 * self.inv_freqs[0].numel()
        assert rot == self.rope_dim, f"rotary module turns {rot} dims, config says {self.rope_dim}"

    def shift_layer(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, delta: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # keys: [1, 1, n, kv_lora_rank] latent (no position); values: [1, 1, n, rope_dim] k_rot
        assert values.shape[-1] == self.rope_dim, (
            f"MLA value slot has {values.shape[-1]} dims, expected qk_rope_head_dim={self.rope_dim}"
        )
        rotate = rotate_pairs if self.layout in ("complex", "interleaved") else rotate_keys
        return keys, rotate(values, self.inv_freqs[layer], delta)

    def describe(self) -> dict[str, object]:
        info = super().describe()
        info.update(kv_lora_rank=self.kv_lora_rank, rope_dim=self.rope_dim,
                    rotary_pairs="half" if self.layout == "half" else "adjacent",
                    rotary_slot="values")
        return info
