"""The CPU attention kernel: same logits as transformers' sdpa, without repeating K/V heads."""

from __future__ import annotations

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa
from conftest import make_tiny_engine

from kvnotes.core import attention

TEXT = "Refunds go to the original card within 30 days of delivery for unused items. " * 3
QUERY = " Is a refund for a backpack delivered 41 days ago allowed? Answer yes or no."


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "mistral"])
def test_grouped_kernel_matches_sdpa(arch, tokenizer):
    """A multi-token forward on top of a notebook (masked, grouped heads: the path that used to
    copy K/V) gives the logits of transformers' own sdpa; sliding windows included."""
    engine = make_tiny_engine(arch, tokenizer)
    assert engine.grouped_attention
    assert engine.model.config._attn_implementation == attention.NAME
    nb = engine.prefill(TEXT)
    ids = engine.encode(QUERY)
    grouped = engine.probe(nb, ids)  # [q, vocab]
    engine.model.set_attn_implementation("sdpa")
    try:
        plain = engine.probe(nb, ids)
    finally:
        engine.model.set_attn_implementation(attention.NAME)
    assert torch.allclose(grouped, plain, atol=1e-5, rtol=0)
    assert torch.equal(grouped.argmax(-1), plain.argmax(-1))


def test_grouped_kernel_never_repeats_kv(tokenizer, monkeypatch):
    """The point of the kernel: no forward (prefill, request on top, decode) calls repeat_kv."""
    engine = make_tiny_engine("llama", tokenizer)
    assert engine.model.config.num_key_value_heads < engine.model.config.num_attention_heads

    def refuse(*_args, **_kwargs):
        raise AssertionError("repeat_kv copied the key/value heads")

    monkeypatch.setattr(hf_sdpa, "repeat_kv", refuse)
    nb = engine.prefill(TEXT)
    nb = engine.extend(nb, QUERY)
    engine.greedy(nb, None, 3)


def test_plain_sdpa_repeats_kv_on_this_path(tokenizer, monkeypatch):
    """The control for the test above: transformers' sdpa does copy on that path, so the test
    above can fail."""
    engine = make_tiny_engine("llama", tokenizer)
    engine.model.set_attn_implementation("sdpa")
    calls = []
    original = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda *a: calls.append(1) or original(*a))
    engine.extend(engine.prefill(TEXT), QUERY)
    assert calls


def test_not_switched_off_cpu_or_off_sdpa(tokenizer):
    model = make_tiny_engine("llama", tokenizer).model
    model.set_attn_implementation("eager")
    assert not attention.use_grouped_sdpa(model, torch.device("cpu"))
    assert model.config._attn_implementation == "eager"
    model.set_attn_implementation("sdpa")
    assert not attention.use_grouped_sdpa(model, torch.device("meta"))
    assert model.config._attn_implementation == "sdpa"
