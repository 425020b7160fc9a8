"""Tiny random models of many architectures, built offline in well under a second.

For tests, ``kvnotes doctor --tiny ARCH`` and quick experiments: hidden size 64, 2 layers, small
heads. ``TINY_ARCHS`` lists the config overrides each architecture needs to be that small (this
table builds configs; no behaviour anywhere branches on it).
"""

from __future__ import annotations

from typing import Any

import torch

from kvnotes.core.errors import UnknownNameError

TINY_SIZES: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=4096)

_MOE = dict(num_local_experts=4, num_experts_per_tok=2)
_QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=64)
_MLA = dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16, head_dim=8, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            first_k_dense_replace=1)
_VISION = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)

# architecture -> config overrides (on top of TINY_SIZES)
TINY_ARCHS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "gemma": {"head_dim": 16},
    "mistral": {"sliding_window": 8},
    "gemma2": {"sliding_window": 8, "head_dim": 16},
    "gemma3_text": {"sliding_window": 8, "head_dim": 16,
                    "layer_types": ["sliding_attention", "full_attention"]},
    "starcoder2": {"sliding_window": 8},
    "phi3": {"pad_token_id": 0},
    "olmo2": {},
    "granite": {},
    "cohere": {},
    "gpt_neox": {"rotary_pct": 0.25},
    "stablelm": {"partial_rotary_factor": 0.25},
    "phi": {"partial_rotary_factor": 0.5},
    "mixtral": _MOE,
    "qwen2_moe": _QWEN_MOE,
    "qwen3_moe": {**_QWEN_MOE, "head_dim": 16},
    "deepseek_v2": {**_MLA, "topk_method": "greedy"},
    "deepseek_v3": {**_MLA, "n_group": 1, "topk_group": 1},
    "qwen2_vl": {"rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                     "rope_theta": 10000.0},
                 "vision_config": {**_VISION, "hidden_size": 64}},
    "qwen2_5_vl": {"rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                       "rope_theta": 10000.0},
                   "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64,
                                     "num_heads": 2, "out_hidden_size": 64, "patch_size": 14,
                                     "spatial_merge_size": 2, "temporal_patch_size": 2,
                                     "window_size": 56, "fullatt_block_indexes": [0]}},
    "bloom": {"n_layer": 2, "n_head": 4},
    "gpt2": {"n_layer": 2, "n_head": 4, "n_embd": 64, "n_positions": 4096},
}

# architectures whose auto class is image-text-to-text rather than causal LM
_MULTIMODAL = {"qwen2_vl", "qwen2_5_vl"}


def tiny_config(arch: str, vocab_size: int, **overrides: Any) -> Any:
    """A transformers config for a tiny ``arch`` model with ``vocab_size`` tokens."""
    from transformers import AutoConfig

    if arch not in TINY_ARCHS:
        raise UnknownNameError("arch", arch, sorted(TINY_ARCHS), "no tiny recipe for it")
    kwargs = {**TINY_SIZES, "vocab_size": vocab_size, **TINY_ARCHS[arch], **overrides}
    if arch in _MULTIMODAL:
        text = {k: v for k, v in kwargs.items() if k != "vision_config"}
        # image placeholder ids must lie inside the (small) vocabulary
        ids = dict(image_token_id=vocab_size - 3, video_token_id=vocab_size - 2,
                   vision_start_token_id=vocab_size - 5, vision_end_token_id=vocab_size - 4)
        return AutoConfig.for_model(arch, text_config=text, vision_config=kwargs["vision_config"],
                                    **ids)
    return AutoConfig.for_model(arch, **kwargs)


def tiny_model(arch: str, vocab_size: int, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A tiny random fp32 model of ``arch`` in eval mode (offline, deterministic per seed)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = tiny_config(arch, vocab_size, **overrides)
    auto = AutoModelForImageTextToText if arch in _MULTIMODAL else AutoModelForCausalLM
    torch.manual_seed(seed)
    return auto.from_config(config, dtype=torch.float32).eval()


class ByteTokenizer:
    """A stand-in tokenizer for tiny models: one id per UTF-8 byte, no special tokens.

    Enough for :class:`kvnotes.Engine` (fingerprint, BOS rule, encode/decode) where no real
    tokenizer is at hand (``kvnotes doctor --tiny ARCH``).
    """

    bos_token_id = None
    eos_token_id = None
    all_special_tokens: list[str] = []
    chat_template = None

    def __init__(self, vocab_size: int = 256) -> None:
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [b % self.vocab_size for b in text.encode()]}

    def get_vocab(self) -> dict[str, int]:
        return {f"<{i}>": i for i in range(self.vocab_size)}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")
