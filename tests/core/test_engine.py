"""Engine: prefill, compose, next_logits, generate, skills, clear errors (tiny models)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_engine

import kvnotes
from kvnotes import Document, Field

POLICY = "Refunds are issued within five days. Final-sale items cannot be returned."


def test_prefill_positions_spans_and_bos_rule(tiny_llama):
    doc = Document(["Order ", Field("status", "pending"), " today."])
    nb = tiny_llama.prefill(doc, start=5)
    assert nb.positions.tolist() == list(range(5, 5 + len(nb)))
    span = nb.span("status")
    assert tiny_llama.decode(nb.token_ids[span.start:span.end]) == "pending"
    assert nb.fields == ["status"]
    assert not tiny_llama.adds_bos  # SmolLM2's tokenizer adds no BOS by default
    assert nb.token_ids.tolist() == tiny_llama.tokens_of(doc)[0]


def test_compose_single_text_part_equals_prefill(tiny_llama):
    composed = tiny_llama.compose([POLICY])
    plain = tiny_llama.prefill(POLICY)
    assert torch.equal(composed.token_ids, plain.token_ids)
    for l in range(plain.num_layers):
        assert torch.allclose(composed.keys(l), plain.keys(l), atol=1e-6)


def test_compose_with_skill_matches_recompute_on_tiny_model(tiny_llama):
    skill = tiny_llama.compile(POLICY, name="refunds")
    assert skill.positions[0] == 0 and skill.meta["anchor"] == "none"
    nb = tiny_llama.compose(["Customer asks about a refund. ", skill, " Answer:"])
    assert nb.meta["compose"] == {"reused": len(skill), "computed": len(nb) - len(skill)}
    assert nb.positions.tolist() == list(range(len(nb)))
    assert nb.span("refunds").end - nb.span("refunds").start == len(skill)
    report = kvnotes.fidelity(tiny_llama, ["Customer asks about a refund. ", skill, " Answer:"],
                              " yes", max_new_tokens=4)
    assert report.tokens_reused == len(skill)
    # The spliced skill never saw the context: close to, but not exactly, recompute.
    assert report.logit_cosine > 0.9


def test_bos_anchored_skill_at_position_one_is_exact(tokenizer):
    engine = make_tiny_engine("llama", tokenizer)
    # force the BOS-anchored path: spliced right after BOS it must equal prefill exactly
    skill = engine.compile(POLICY, anchor="bos")
    assert skill.positions[0] == 1
    bos = tokenizer.bos_token_id
    full = engine.prefill([bos, *engine.encode(POLICY)])
    spliced = kvnotes.Notebook.concat([full.slice(0, 1), skill])
    for l in range(full.num_layers):
        assert torch.allclose(spliced.keys(l), full.keys(l), atol=1e-5)


def test_next_logits_without_query_equals_prefill_logits(tiny_llama):
    ids = tiny_llama.encode(POLICY)
    nb = tiny_llama.prefill(ids)
    with torch.no_grad():
        own = tiny_llama.model(torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(tiny_llama.next_logits(nb), own, atol=1e-5)


def test_generate_is_greedy_and_deterministic(tiny_llama):
    nb = tiny_llama.prefill(POLICY)
    a = tiny_llama.greedy(nb, " Next:", max_new_tokens=5)
    b = tiny_llama.greedy(nb, " Next:", max_new_tokens=5)
    assert a.token_ids == b.token_ids and len(a.token_ids) <= 5
    assert a.token_ids[0] == int(tiny_llama.next_logits(nb, " Next:").argmax())
    assert len(a.notebook) == len(nb) + len(tiny_llama.encode(" Next:")) + len(a.token_ids) - 1


def test_empty_input_is_a_clear_error(tiny_llama):
    with pytest.raises(kvnotes.EmptyInputError, match="empty input"):
        tiny_llama.prefill("")
    with pytest.raises(kvnotes.EmptyInputError):
        tiny_llama.prefill([])
    with pytest.raises(kvnotes.EmptyInputError, match="at least one part"):
        tiny_llama.compose([])
    with pytest.raises(kvnotes.EmptyInputError, match="no tokens"):
        tiny_llama.prefill(Document([Field("x", "")]))


def test_positions_past_the_maximum_are_refused(tiny_llama):
    limit = tiny_llama.adapter.max_positions
    with pytest.raises(kvnotes.PositionError, match="max_position_embeddings=4096"):
        tiny_llama.prefill(POLICY, start=limit - 3)
    nb = tiny_llama.prefill(POLICY)
    with pytest.raises(kvnotes.PositionError, match="past this model's maximum"):
        nb.shifted(limit)


def test_unknown_field_lists_the_fields(tiny_llama):
    nb = tiny_llama.prefill(Document(["a ", Field("status", "x"), Field("tier", "gold")]))
    with pytest.raises(kvnotes.UnknownFieldError, match=r"spans: \['text0', 'status', 'tier'\]"):
        nb.span("colour")
    with pytest.raises(kvnotes.UnknownFieldError, match=r"fields: \['status', 'tier'\]"):
        Document(["a ", Field("status", "x"), Field("tier", "gold")]).with_value("colour", "red")


def test_skill_library_compiles_once(tiny_llama, tmp_path):
    lib = kvnotes.SkillLibrary(tmp_path, tiny_llama)
    first = lib.get(POLICY, name="refunds")
    second = kvnotes.SkillLibrary(tmp_path, tiny_llama).get(POLICY, name="refunds")
    assert lib.misses == 1 and len(lib) == 1
    assert torch.equal(first.keys(0), second.keys(0))
    again = kvnotes.SkillLibrary(tmp_path, tiny_llama)
    again.get(POLICY)
    assert (again.hits, again.misses) == (1, 0)


def test_unknown_model_alias_is_a_clear_error():
    with pytest.raises(kvnotes.UnknownModelError, match="not a bundled alias.*smollm2-135m"):
        kvnotes.load("no-such-model")
    with pytest.raises(kvnotes.UnknownModelError, match="empty model name"):
        kvnotes.load("")


def test_chat_frame_keeps_a_template_token_the_tokenizer_never_adds(tokenizer):
    from kvnotes.core.chat import chat_frame, chat_turn

    # SmolLM2's bos_token is <|im_start|>, which tokenizer(text) never adds: it must stay.
    head, middle, tail = chat_frame(tokenizer)
    assert head.startswith("<|im_start|>system\n")
    assert middle.endswith("<|im_start|>user\n") and tail.endswith("<|im_start|>assistant\n")
    assert chat_turn(tokenizer, "system", "hi").startswith("<|im_start|>system\n")
