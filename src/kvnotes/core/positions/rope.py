"""Rotary position embeddings (RoPE), including per-layer-type RoPE (Gemma 2/3) and partial rotary.

For RoPE whose frequencies do not depend on sequence length, ``R(p + d) = R(d) R(p)``: keys
cached at position ``p`` move to ``p + d`` by one more rotation with angle ``d * inv_freq``.
The attention scaling some schemes fold into cos/sin (YaRN's mscale) was already applied once
to the stored key, and a pure rotation keeps it, so re-rotation never rescales.

Scaling schemes whose frequencies depend on the sequence length (``dynamic`` NTK, ``longrope``'s
short/long switch) are exact only inside one regime; the adapter is then flagged ``approximate``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from kvnotes.core.positions.base import PositionAdapter, register_adapter

# rope types whose inverse frequencies change with the sequence length
LENGTH_DEPENDENT_ROPE = {"dynamic": "dynamic NTK rescales frequencies once the sequence grows "
                                    "past the original maximum",
                         "longrope": "LongRoPE switches between short and long factors at the "
                                     "original maximum length"}


def find_rotary_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model-level rotary embedding module (the one holding ``inv_freq`` buffers), if any."""
    for name, module in model.named_modules():
        if not name.endswith("rotary_emb"):
            continue
        if hasattr(module, "inv_freq") or any(b.endswith("_inv_freq") for b, _ in
                                               module.named_buffers(recurse=False)):
            return module
    return None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The half-split rotation used by Llama-style RoPE: (x1, x2) -> (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_keys(keys: torch.Tensor, inv_freq: torch.Tensor, delta: int | torch.Tensor, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate post-RoPE keys ``[b, h, n, d]`` by ``delta`` positions (int or LongTensor[n]).

    Only the first ``2 * len(inv_freq)`` dims of each head turn (partial rotary leaves the
    rest as is). Angles, cos and sin are computed in float64 and rounded once; the rotation
    itself runs in float32 (or the keys' dtype when wider), so a shift adds about one float32
    rounding per element. A scalar ``delta`` turns every token alike: one cos/sin vector.

    ``out`` (same shape and dtype as ``keys``, not overlapping it) receives the result; for
    float32/float64 keys and a scalar ``delta`` it is written directly, with no intermediate
    tensor the size of the keys (a splice at memory speed).
    """
    rot_dim = 2 * inv_freq.numel()
    d = torch.as_tensor(delta, dtype=torch.float64, device=keys.device)
    freqs = inv_freq.to(device=keys.device, dtype=torch.float64)
    angles = d * freqs if d.dim() == 0 else d[:, None] * freqs[None, :]  # [rot/2] or [n, rot/2]
    work = torch.float64 if keys.dtype == torch.float64 else torch.float32
    if out is not None and d.dim() == 0 and keys.dtype == work:
        half = rot_dim // 2
        cos, sin = angles.cos().to(work), angles.sin().to(work)  # [rot/2] each
        x1, x2 = keys[..., :half], keys[..., half:rot_dim]
        o1, o2 = out[..., :half], out[..., half:rot_dim]
        # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), as rot * cos + rotate_half(rot) * sin
        torch.mul(x1, cos, out=o1)
        o1.addcmul_(x2, sin, value=-1)
        torch.mul(x2, cos, out=o2)
        o2.addcmul_(x1, sin)
        if rot_dim < keys.shape[-1]:
            out[..., rot_dim:].copy_(keys[..., rot_dim:])
        return out
    angles = torch.cat((angles, angles), dim=-1)  # [rot] or [n, rot]
    cos, sin = angles.cos().to(work), angles.sin().to(work)
    rot, rest = keys[..., :rot_dim].to(work), keys[..., rot_dim:]
    turned = (rot * cos + rotate_half(rot) * sin).to(keys.dtype)
    result = torch.cat((turned, rest), dim=-1) if rest.numel() else turned
    if out is not None:
        out.copy_(result)
        return out
    return result


def _has_standard_rotary(model: torch.nn.Module) -> bool:
    return find_rotary_module(model) is not None


@register_adapter(_has_standard_rotary)
class RopeAdapter(PositionAdapter):
    """Standard RoPE (any length-independent scaling), per-layer-type RoPE, partial rotary."""

    name: ClassVar[str] = "rope"
    exact_shift = True

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        # a transformers rotary module: its buffers and rope_type differ per model class
        rotary: Any = find_rotary_module(model)
        assert rotary is not None
        layer_types = getattr(self.config, "layer_types", None) or ["full_attention"] * self.num_layers
        per_type = hasattr(rotary, "layer_types") and not hasattr(rotary, "inv_freq")
        self.inv_freqs: list[torch.Tensor] = []
        rope_types: set[str] = set()
        for layer in range(self.num_layers):
            if per_type:
                inv = getattr(rotary, f"{layer_types[layer]}_inv_freq")
                rope_types.add(rotary.rope_type[layer_types[layer]])
            else:
                inv = rotary.inv_freq
                rope_types.add(getattr(rotary, "rope_type", "default"))
            # original_inv_freq: dynamic schemes mutate inv_freq during long forwards
            self.inv_freqs.append(inv.detach().to("cpu", torch.float64).clone())
        self.rope_types = sorted(rope_types)
        self.sliding_window: int | None = getattr(self.config, "sliding_window", None)
        self.layer_types = list(layer_types)
        length_dependent = [t for t in self.rope_types if t in LENGTH_DEPENDENT_ROPE]
        if length_dependent:
            self.approximate_reason = (
                f"rope_type {length_dependent[0]!r}: {LENGTH_DEPENDENT_ROPE[length_dependent[0]]}; "
                "re-rotation is exact only while all positions stay inside one regime"
            )
            self.exact_shift, self.approximate = False, True

    def shift_layer(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, delta: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotate_keys(keys, self.inv_freqs[layer], delta), values

    def shift_layer_into(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, delta: int,
        out_keys: torch.Tensor, out_values: torch.Tensor,
    ) -> None:
        if type(self).shift_layer is not RopeAdapter.shift_layer:  # a subclass turns other dims
            super().shift_layer_into(layer, keys, values, delta, out_keys, out_values)
            return
        rotate_keys(keys, self.inv_freqs[layer], delta, out=out_keys)
        out_values.copy_(values)

    def describe(self) -> dict[str, object]:
        info = super().describe()
        info.update(
            rope_types=self.rope_types,
            rotary_dims=sorted({2 * f.numel() for f in self.inv_freqs}),
            sliding_window=self.sliding_window,
        )
        return info
