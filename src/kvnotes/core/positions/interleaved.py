"""Interleaved RoPE (Cohere, GPT-J style): each pair of adjacent dims ``(2i, 2i+1)`` turns together.

Llama-style RoPE pairs dim ``i`` with dim ``i + rot/2`` (the "half split"); interleaved RoPE pairs
``2i`` with ``2i+1``. Both are rotations by ``p * inv_freq[i]``, so ``R(p + d) = R(d) R(p)`` holds
and re-rotation is exact; only the pairing differs. Which layout a model uses is read from its
rotary module's output (see :func:`rotary_layout`), never from ``model_type``.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvnotes.core.positions.base import register_adapter
from kvnotes.core.positions.rope import RopeAdapter, find_rotary_module


def rotary_layout(rotary: torch.nn.Module) -> str | None:
    """How a rotary module lays its angles out: ``"half"``, ``"interleaved"`` or ``"complex"``.

    Asks the module for cos/sin at position 1 (where every frequency gives a different angle):
    ``cat(freqs, freqs)`` is the half split, ``repeat_interleave(freqs, 2)`` the interleaved
    layout, and a complex tensor (``freqs_cis``) rotates interleaved pairs as complex numbers.
    ``None`` when the module cannot be asked that way.
    """
    # on the module's own device: a CUDA rotary module given CPU positions would raise, and the
    # layout would silently read as unknown
    device = next((b.device for b in rotary.buffers()), torch.device("cpu"))
    probe = torch.zeros(1, 1, 1, device=device)
    position_ids = torch.ones(1, 1, dtype=torch.long, device=device)
    try:
        with torch.no_grad():
            out = rotary(probe, position_ids)
    except Exception:  # a rotary module with another signature (per-layer-type, ...)
        return None
    if torch.is_tensor(out) and out.is_complex():
        return "complex"
    if not isinstance(out, tuple) or not torch.is_tensor(out[0]):
        return None
    cos = out[0].reshape(-1).double()
    if cos.numel() < 4:
        return None
    half = cos.numel() // 2
    if torch.allclose(cos[:half], cos[half:]):
        return "half"
    if torch.allclose(cos[0::2], cos[1::2]):
        return "interleaved"
    return None


def rotate_pairs(
    x: torch.Tensor, inv_freq: torch.Tensor, delta: int | torch.Tensor
) -> torch.Tensor:
    """Rotate ``[..., n, d]`` tensors whose RoPE pairs are adjacent dims by ``delta`` positions.

    Only the first ``2 * len(inv_freq)`` dims turn; angles are computed in float64.
    """
    rot_dim = 2 * inv_freq.numel()
    n = x.shape[-2]
    d = torch.as_tensor(delta, dtype=torch.float64, device=x.device)
    d = d.expand(n) if d.dim() == 0 else d
    angles = d[:, None] * inv_freq.to(device=x.device, dtype=torch.float64)[None, :]  # [n, rot/2]
    cos, sin = angles.cos(), angles.sin()
    rot, rest = x[..., :rot_dim].double(), x[..., rot_dim:]
    even, odd = rot[..., 0::2], rot[..., 1::2]  # [..., n, rot/2] each
    turned = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    turned = turned.flatten(-2).to(x.dtype)
    return torch.cat((turned, rest), dim=-1) if rest.numel() else turned


def _has_interleaved_rotary(model: torch.nn.Module) -> bool:
    rotary = find_rotary_module(model)
    return (rotary is not None and hasattr(rotary, "inv_freq")
            and rotary_layout(rotary) == "interleaved")


@register_adapter(_has_interleaved_rotary, priority=10)
class InterleavedRopeAdapter(RopeAdapter):
    """RoPE whose rotation pairs are adjacent dims (Cohere); otherwise as :class:`RopeAdapter`."""

    name: ClassVar[str] = "rope_interleaved"

    def shift_layer(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, delta: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotate_pairs(keys, self.inv_freqs[layer], delta), values

    def describe(self) -> dict[str, object]:
        info = super().describe()
        info.update(rotary_pairs="adjacent")
        return info
