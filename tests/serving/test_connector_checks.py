"""What the connector refuses at server start, each with the message that names the fix.

The weights check reads model folders written here (safetensors shards) and the part of vLLM's
config it needs (``model_config.model``), no vLLM."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

import kvnotes.serving.library.weights as weights_mod
from kvnotes.core.errors import ServingError
from kvnotes.serving.library.manifest import ServingManifest
from kvnotes.serving.library.weights import SAMPLES, weights_digest
from kvnotes.serving.vllm.checks import (
    ServedModel,
    check_layers,
    check_rope,
    check_served,
    check_weights,
    layer_index,
)

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


# ---- the served weights -------------------------------------------------------------------------
def weights_folder(path, tensors: dict[str, torch.Tensor]):
    """A model folder as vLLM reads one: two safetensors shards and a config."""
    path.mkdir(parents=True)
    names = sorted(tensors)
    for i, part in enumerate((names[::2], names[1::2])):
        save_file({n: tensors[n].contiguous() for n in part},
                  str(path / f"model-0000{i + 1}-of-00002.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text("{}")
    return path


def source_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(300, 16, generator=g),
            "model.layers.0.self_attn.k_proj.weight": torch.randn(64, 16, generator=g),
            "model.layers.1.self_attn.v_proj.weight": torch.randn(64, 16, generator=g),
            "model.norm.weight": torch.randn(16, generator=g)}


def cast(tensors, dtype):  # what kvnotes.serving.launch.export does to every floating tensor
    return {n: t.to(dtype) if t.is_floating_point() else t for n, t in tensors.items()}


def served_config(folder):
    """The part of vLLM's config the weights check reads."""
    return SimpleNamespace(model_config=SimpleNamespace(model=str(folder)))


@pytest.fixture
def compiled(tmp_path):
    src = weights_folder(tmp_path / "source", source_tensors())
    return replace(MANIFEST, weights=weights_digest(src).to_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_cast_copy_of_the_compiled_weights_is_served(compiled, tmp_path, dtype):
    copy = weights_folder(tmp_path / "served", cast(source_tensors(), dtype))
    name = str(dtype).removeprefix("torch.")
    cfg = served_config(copy)
    assert check_weights(compiled, cfg.model_config.model, "skills/") == compiled.weights[
        "sha256"][name]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fine_tune_of_the_same_shape_is_refused(compiled, tmp_path, dtype):
    tuned = source_tensors()
    tuned["model.layers.1.self_attn.v_proj.weight"] += 0.05  # one matrix moved: an adapter merged
    folder = weights_folder(tmp_path / "tuned", cast(tuned, dtype))
    with pytest.raises(ServingError, match=r"kvnotes skills in skills/ were compiled with other "
                                           r"weights than the ones served from .*tuned \(same "
                                           r"shape, different values: a fine-tune"):
        check_weights(compiled, served_config(folder).model_config.model, "skills/")


def test_a_manifest_without_a_weights_digest_is_refused(tmp_path):
    folder = weights_folder(tmp_path / "served", source_tensors())
    with pytest.raises(ServingError, match=r"serving.json records no digest of the weights .* "
                                           r"Re-export the skills with this kvnotes"):
        check_weights(MANIFEST, served_config(folder).model_config.model, "skills/")


def test_weights_the_connector_cannot_fingerprint_are_refused(compiled, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    for model in (gguf, "HuggingFaceTB/SmolLM2-135M-Instruct"):
        with pytest.raises(ServingError, match="is not a local folder of .safetensors weights"):
            check_weights(compiled, served_config(model).model_config.model, "skills/")
    wide = weights_folder(tmp_path / "f64", cast(source_tensors(), torch.float64))
    with pytest.raises(ServingError, match=r"are float64; the skills' manifest has digests for "
                                           r"\['bfloat16', 'float16', 'float32'\]"):
        check_weights(compiled, str(wide), "skills/")
    mixed = cast(source_tensors(), torch.bfloat16)
    mixed["model.norm.weight"] = mixed["model.norm.weight"].float()
    with pytest.raises(ServingError, match=r"float tensors of \['bfloat16', 'float32'\] dtype"):
        check_weights(compiled, str(weights_folder(tmp_path / "mixed", mixed)), "skills/")


def test_the_digest_reads_headers_and_samples_not_the_weights(tmp_path, monkeypatch):
    tensors = source_tensors()
    folder = weights_folder(tmp_path / "source", tensors)
    read = []
    real = weights_mod.os.pread
    monkeypatch.setattr(weights_mod.os, "pread", lambda fd, n, off: read.append(n) or
                        real(fd, n, off))
    digest = weights_digest(folder)
    assert digest.tensors == len(tensors)
    # SAMPLES elements of each tensor (all 16 of the norm), 4 bytes each, and nothing else
    assert sum(read) == 4 * SAMPLES * len(tensors)
    assert sum(read) < sum(t.numel() * 4 for t in tensors.values()) / 50


def test_published_skills_record_the_weights_their_engine_was_loaded_from(tiny_folder, tmp_path):
    """The real path: skills published from a model folder, served from its bfloat16 export."""
    import kvnotes
    from kvnotes.serving.launch.export import export_hf_dir
    from kvnotes.serving.skills import ServingSkills

    skills = ServingSkills(tmp_path / "skills", kvnotes.load(str(tiny_folder)))
    manifest = ServingManifest.read(skills.folder)
    assert manifest.weights == weights_digest(tiny_folder).to_dict()
    served = export_hf_dir(str(tiny_folder), tmp_path / "export", dtype="bfloat16")
    assert check_weights(manifest, served_config(served).model_config.model, skills.folder) == \
        manifest.weights["sha256"]["bfloat16"]
