"""What the connector refuses at server start, each with the message that names the fix."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kvnotes.core.errors import ServingError
from kvnotes.serving.connector_checks import (
    ServedModel,
    check_layers,
    check_rope,
    check_served,
    layer_index,
)
from kvnotes.serving.manifest import ServingManifest

HEAD_DIM = 16


def inv_freq(base: float, dim: int = HEAD_DIM) -> list[float]:
    return [base ** (-2 * j / dim) for j in range(dim // 2)]


MANIFEST = ServingManifest(fingerprint={}, model="tiny", scheme="rope", num_layers=2,
                           num_kv_heads=4, head_dim=HEAD_DIM, vocab_size=300, bos_id=None,
                           inv_freqs=[inv_freq(10000.0)] * 2)
SERVED = ServedModel(num_layers=2, num_kv_heads=4, head_dim=HEAD_DIM)


@pytest.mark.parametrize(("change", "message"), [
    (dict(num_layers=3), r"compiled for tiny \(layers, kv heads, head dim = \(2, 4, 16\)\)"),
    (dict(mla=True), "uses MLA"),
    (dict(speculative_method="eagle3"), "speculative decoding 'eagle3' runs draft layers"),
    (dict(lora=True), "LoRA is enabled"),
    (dict(decode_context_parallel=2), "--decode-context-parallel-size 1"),
    (dict(prefill_context_parallel=2), "context parallelism"),
])
def test_served_configurations_the_connector_refuses(change, message):
    with pytest.raises(ServingError, match=message):
        check_served(MANIFEST, replace(SERVED, **change), "skills/")


def test_a_plain_or_tensor_parallel_server_is_accepted():
    check_served(MANIFEST, SERVED, "skills/")
    check_served(MANIFEST, replace(SERVED, tensor_parallel=4), "skills/")


class Impl:
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        raise AssertionError("not called at start")


class MlaImpl:
    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype,
                           k_scale):
        raise AssertionError("not called at start")


def attention(heads=4, head_size=HEAD_DIM, impl=None, dtype=torch.bfloat16, **extra):
    cache = torch.zeros(3, heads, 32, 2 * head_size, dtype=dtype, device="meta")
    layer = SimpleNamespace(impl=impl or Impl(), num_kv_heads=heads, head_size=head_size,
                            kv_cache_dtype="auto", kv_cache=cache, **extra)
    return layer


def caches(layers):
    return {name: layer.kv_cache for name, layer in layers.items()}


def test_layers_are_mapped_to_the_manifest():
    layers = {f"model.layers.{i}.self_attn.attn": attention() for i in (1, 0)}
    assert check_layers(MANIFEST, layers, caches(layers), heads=range(4),
                        dtype=torch.bfloat16) == [(0, "model.layers.0.self_attn.attn"),
                                                  (1, "model.layers.1.self_attn.attn")]
    assert layer_index("model.layers.12.self_attn.attn") == 12 and layer_index("lm_head") is None


def test_a_pipeline_stage_writes_its_own_layers_only():
    layers = {"model.layers.1.self_attn.attn": attention()}
    assert check_layers(MANIFEST, layers, caches(layers), heads=range(4),
                        dtype=torch.bfloat16) == [(1, "model.layers.1.self_attn.attn")]


@pytest.mark.parametrize(("name", "layer", "heads", "message"), [
    ("model.layers.2.self_attn.attn", attention(), range(4),
     "beyond the 2 layers of tiny .a speculative-decoding draft layer"),
    ("model.layers.1.self_attn.attn", attention(kv_sharing_target_layer_name="model.layers.0"),
     range(4), "shares the KV cache of 'model.layers.0'"),
    ("model.layers.1.self_attn.attn", attention(impl=MlaImpl()), range(4),
     "MLA's latent cache write"),
    ("model.layers.1.self_attn.attn", attention(heads=4), range(2, 4),
     r"holds 4 KV heads of size 16; this rank should write 2 of the 4 heads \(heads 2..3\)"),
    ("model.layers.1.self_attn.attn", attention(dtype=torch.float16), range(4),
     "is torch.float16 but the model runs in torch.bfloat16"),
    ("model.layers.1.self_attn.attn",
     attention(attn_backend=SimpleNamespace(forward_includes_kv_cache_update=True)), range(4),
     "writes the cache inside its forward"),
    ("encoder.attn", attention(), range(4), "has no 'layers.<i>.' index"),
])
def test_layers_the_connector_cannot_write_are_refused(name, layer, heads, message):
    layers = {"model.layers.0.self_attn.attn": attention(heads=len(heads)), name: layer}
    with pytest.raises(ServingError, match=message):
        check_layers(MANIFEST, layers, caches(layers), heads=heads, dtype=torch.bfloat16)


def test_fp8_caches_are_left_to_the_backend():
    layer = attention(dtype=torch.uint8)
    layer.kv_cache_dtype = "fp8"
    layers = {"model.layers.0.self_attn.attn": layer}
    assert check_layers(MANIFEST, layers, caches(layers), heads=range(4), dtype=torch.bfloat16)


def rotary(base: float, *, dim=HEAD_DIM, positions=4096, neox=True, dtype=torch.float32):
    inv = torch.tensor(inv_freq(base, dim), dtype=torch.float32)
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv[None, :]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)
    return SimpleNamespace(cos_sin_cache=cache, is_neox_style=neox)


def test_rope_tables_equal_to_vllms_rotary_embedding_pass():
    assert check_rope(MANIFEST, [rotary(10000.0, dtype=torch.bfloat16)]) == 1
    # per-layer-type RoPE (Gemma 3: local and global bases): each table must be one of them
    two = replace(MANIFEST, inv_freqs=[inv_freq(10000.0), inv_freq(1e6)])
    assert check_rope(two, [rotary(1e6), rotary(10000.0)]) == 2


@pytest.mark.parametrize("embedding", [rotary(100000.0), rotary(10000.0, neox=False),
                                       rotary(10000.0, dim=8)])
def test_a_changed_rope_is_refused(embedding):
    with pytest.raises(ServingError, match=r"RoPE table for layer 0 \(8 frequencies, base "
                                           r"~1e\+04\) is none of the served model's"):
        check_rope(MANIFEST, [embedding])


def test_no_rotary_embedding_found_is_reported_not_refused():
    assert check_rope(MANIFEST, []) == 0
    assert check_rope(MANIFEST, [SimpleNamespace(cos_sin_cache=None)]) == 0
