"""Architecture matrix: every position scheme on tiny random models of many architectures.

For each architecture: the adapter picked from the config, ``prefill(x, 0).shifted(p)`` against
``prefill(x, p)`` (<= 1e-4 fp32) wherever ``doctor`` says the shift is exact, composition end to
end, and the documented error where moving notes is unsupported.

This module overrides the session ``tokenizer`` fixture with a byte-level stand-in: with a
256-token vocabulary each tiny model builds in milliseconds instead of seconds, and positions do
not care what the tokens spell.
"""

from __future__ import annotations

import json
from functools import cache

import pytest
import torch

import kvnotes
from kvnotes.core.errors import PositionError, UnsupportedModelError
from kvnotes.core.positions import adapter_for
from kvnotes.core.positions.capabilities import capabilities, check_shift, shift_status
from kvnotes.core.positions.mrope import mrope_axes
from kvnotes.core.tiny import TINY_ARCHS, ByteTokenizer, tiny_model
from kvnotes.ops.multimodal import prefill_multimodal

TOL = 1e-4
DELTA = 37
TEXT = "Order 1042: status pending. Refunds need a receipt. The quick brown fox jumps."

# architecture -> the position scheme its config must select
SCHEMES = {
    "llama": "rope", "qwen2": "rope", "qwen3": "rope", "gemma": "rope", "phi3": "rope",
    "olmo2": "rope", "granite": "rope", "mistral": "rope", "gemma2": "rope",
    "gemma3_text": "rope", "starcoder2": "rope",
    "gpt_neox": "rope", "stablelm": "rope", "phi": "rope",  # partial rotary
    "cohere": "rope_interleaved",
    "mixtral": "rope", "qwen2_moe": "rope", "qwen3_moe": "rope",  # mixture of experts
    "deepseek_v2": "mla", "deepseek_v3": "mla",
    "qwen2_vl": "mrope", "qwen2_5_vl": "mrope",
    "bloom": "alibi",
    "gpt2": "learned_absolute",
}


@pytest.fixture(scope="module")
def tokenizer() -> ByteTokenizer:
    return ByteTokenizer(256)


@cache
def _engine(arch: str, tokenizer, overrides: str) -> kvnotes.Engine:
    model = tiny_model(arch, len(tokenizer), **json.loads(overrides))
    return kvnotes.Engine.from_model(model, tokenizer, name=f"tiny-{arch}")


def engine_for(arch: str, tokenizer, **overrides) -> kvnotes.Engine:
    """One tiny engine per (architecture, overrides) for the whole session."""
    return _engine(arch, tokenizer, json.dumps(overrides, sort_keys=True))


def max_kv_error(a: kvnotes.Notebook, b: kvnotes.Notebook) -> float:
    return max(max(float((a.keys(i) - b.keys(i)).abs().max()),
                   float((a.values(i) - b.values(i)).abs().max())) for i in range(len(a.layers)))


def test_matrix_covers_the_issue_list():
    assert set(SCHEMES) <= set(TINY_ARCHS)
    assert len(SCHEMES) >= 12


@pytest.mark.parametrize("arch", list(SCHEMES))
def test_shift_matches_prefill_where_exact(arch, tokenizer):
    engine = engine_for(arch, tokenizer)
    assert engine.adapter.name == SCHEMES[arch]
    status, reason = shift_status(engine.adapter)
    at_zero, at_p = engine.prefill(TEXT, 0), engine.prefill(TEXT, DELTA)
    assert at_zero.positions.dtype == torch.long and at_zero.positions.dim() == 1
    if status == "exact":
        moved = at_zero.shifted(DELTA)
        assert torch.equal(moved.positions, at_p.positions)
        assert max_kv_error(moved, at_p) <= TOL
        logits = engine.next_logits(moved, " Answer:"), engine.next_logits(at_p, " Answer:")
        assert float((logits[0] - logits[1]).abs().max()) <= TOL
    else:
        assert status == "unsupported", (arch, status)
        with pytest.raises(PositionError, match="cannot be repositioned"):
            at_zero.shifted(DELTA)
        assert "cannot be repositioned" in reason


@pytest.mark.parametrize("arch", list(SCHEMES))
def test_compose_end_to_end(arch, tokenizer):
    engine = engine_for(arch, tokenizer)
    skill = engine.compile("Refund policy: refunds need a receipt.", name="refunds")
    parts = ["Customer: where is my order?\n", skill, "\nAgent:"]
    if shift_status(engine.adapter)[0] == "unsupported":
        with pytest.raises(PositionError, match="cannot be repositioned"):
            engine.compose(parts)
        # a skill that already sits where it is spliced needs no move
        nb = engine.compose([skill, "\nAgent:"])
    else:
        nb = engine.compose(parts, repair=0)  # the bare splice: re-rotation alone
        assert nb.meta["compose"]["reused"] == len(skill)
        assert torch.equal(nb.positions, torch.arange(len(nb)))
        # the default recomputes the skill's first tokens in context; all of them is a prefill
        repaired = engine.compose(parts).meta["compose"]
        assert repaired["repaired"] == min(32, len(skill)) and len(repaired["regions"]) == 1
        full = engine.compose(parts, repair=1.0)
        assert max_kv_error(full, engine.prefill(full.token_ids)) <= TOL
    logits = engine.next_logits(nb, " Yes")
    assert logits.shape == (len(tokenizer),) and torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_mla_rotates_only_the_value_slot(arch, tokenizer):
    engine = engine_for(arch, tokenizer)
    config = engine.model.config
    nb = engine.prefill(TEXT)
    assert nb.keys(0).shape[-1] == config.kv_lora_rank  # the latent
    assert nb.values(0).shape[-1] == config.qk_rope_head_dim  # the rotary key
    moved = nb.shifted(DELTA)
    assert torch.equal(moved.keys(0), nb.keys(0))
    assert not torch.allclose(moved.values(0), nb.values(0))


def test_deepseek_v3_without_rope_interleave(tokenizer):
    engine = engine_for("deepseek_v3", tokenizer, rope_interleave=False)
    assert check_shift(engine, engine.encode(TEXT)).max_kv_error <= TOL


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 1024},
], ids=lambda r: r["rope_type"])
def test_length_independent_scalings_are_exact(rope, tokenizer):
    engine = engine_for("llama", tokenizer, rope_parameters={**rope, "rope_theta": 10000.0})
    assert shift_status(engine.adapter)[0] == "exact"
    assert check_shift(engine, engine.encode(TEXT), DELTA).max_kv_error <= TOL


def test_dynamic_ntk_is_approximate_and_exact_inside_one_regime(tokenizer):
    engine = engine_for("llama", tokenizer,
                        rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                         "rope_theta": 10000.0})
    status, reason = shift_status(engine.adapter)
    assert status == "approximate" and "dynamic" in reason
    nb = engine.prefill(TEXT)
    with pytest.raises(PositionError, match="allow_approximate=True"):
        nb.shifted(DELTA)
    # all positions stay under max_position_embeddings: one regime, so exact after all
    assert check_shift(engine, engine.encode(TEXT), DELTA).max_kv_error <= TOL


def test_partial_rotary_turns_only_the_rotary_slice(tokenizer):
    engine = engine_for("gpt_neox", tokenizer)  # rotary_pct 0.25: 4 of 16 dims
    nb = engine.prefill(TEXT)
    moved = nb.shifted(DELTA)
    assert torch.equal(moved.keys(0)[..., 4:], nb.keys(0)[..., 4:])
    assert not torch.allclose(moved.keys(0)[..., :4], nb.keys(0)[..., :4])


def test_alibi_shift_is_bookkeeping(tokenizer):
    engine = engine_for("bloom", tokenizer)
    nb = engine.prefill(TEXT)
    moved = nb.shifted(DELTA)
    assert torch.equal(moved.keys(1), nb.keys(1)) and torch.equal(moved.values(1), nb.values(1))
    assert torch.equal(moved.positions, nb.positions + DELTA)


def test_unknown_scheme_lists_the_known_ones():
    class Blank(torch.nn.Module):
        config = kvnotes.core.tiny.tiny_config("llama", 64)  # config alone: no rotary, no embeddings

    with pytest.raises(UnsupportedModelError, match="known schemes: .*mla.*mrope"):
        adapter_for(Blank())


# ---- multimodal: a skill with image tokens (Qwen2-VL M-RoPE) ------------------------------------

def _image_skill(engine: kvnotes.Engine) -> tuple[list[int], dict]:
    config = engine.model.config
    ids = (engine.encode("Photo of the parcel: ") + [config.vision_start_token_id]
           + [config.image_token_id] * 4 + [config.vision_end_token_id]
           + engine.encode(" It is damaged."))
    torch.manual_seed(1)
    image = dict(pixel_values=torch.randn(16, 3 * 2 * 14 * 14),  # one 56x56 image: 4x4 patches
                 image_grid_thw=torch.tensor([[1, 4, 4]]))  # -> 2x2 = 4 image tokens
    return ids, image


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_image_skill_spliced_at_another_offset_matches_prefill_there(arch, tokenizer):
    engine = engine_for(arch, tokenizer)
    ids, image = _image_skill(engine)
    axes = mrope_axes(engine.model, torch.tensor(ids), image_grid_thw=image["image_grid_thw"])
    assert not torch.equal(axes[1], axes[2])  # image tokens really have 2-D positions
    skill = prefill_multimodal(engine, ids, start=0, kind="skill", name="photo", **image)
    context = "Customer: my parcel arrived.\n"
    nb = engine.compose([context, skill])
    # its image tokens' notes need the pixels: the default repair splices it as it is
    assert nb.meta["compose"]["regions"] == [] and nb.meta["compose"]["reused"] == len(skill)
    offset = len(nb) - len(skill)
    there = prefill_multimodal(engine, ids, start=int(nb.positions[offset]), **image)
    assert max_kv_error(nb.slice(offset), there) <= TOL
    assert torch.equal(nb.positions[offset:], there.positions)
    # the image matters: other pixels give other notes
    other = prefill_multimodal(engine, ids, start=0, pixel_values=image["pixel_values"] * 0,
                               image_grid_thw=image["image_grid_thw"])
    assert max_kv_error(other, skill) > 1e-3
    # text after the image continues from the image's extent, as transformers places it
    assert nb.next_position == int(there.positions[-1]) + 1


# ---- doctor -------------------------------------------------------------------------------------

def test_capabilities_name_each_operation(tokenizer):
    ops = {op.name.split(" ")[0]: op
           for op in capabilities(engine_for("gemma2", tokenizer).adapter)}
    assert ops["shift"].status == "exact" and ops["compose"].status == "exact"
    assert ops["int8"].status == "approximate"
    assert ops["sliding-window"].status == "exact"
    gpt2 = {op.name.split(" ")[0]: op
            for op in capabilities(engine_for("gpt2", tokenizer).adapter)}
    assert gpt2["shift"].status == "unsupported"
    assert "cannot be repositioned" in gpt2["shift"].reason


def test_doctor_cli_tiny_json():
    cli = pytest.importorskip("kvnotes.cli")
    from typer.testing import CliRunner

    result = CliRunner().invoke(cli.app, ["doctor", "--tiny", "deepseek_v2", "--check", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["scheme"] == "mla"
    assert report["check"]["max_kv_error"] <= TOL
    result = CliRunner().invoke(cli.app, ["doctor", "--tiny", "gpt2", "--check"])
    assert result.exit_code == 0, result.output
    assert "unsupported" in result.output and "PositionError" in result.output
    result = CliRunner().invoke(cli.app, ["doctor", "--tiny", "nope"])
    assert result.exit_code != 0 and "valid archs:" in result.output


def test_byte_tokenizer_runs_an_engine():
    engine = kvnotes.Engine.from_model(tiny_model("llama", 256), ByteTokenizer(256))
    assert engine.generate(engine.prefill("abc"), "d", max_new_tokens=2) is not None
