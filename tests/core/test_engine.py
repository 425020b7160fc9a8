"""Engine: prefill, compose, next_logits, generate, skills, clear errors (tiny models)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_tiny_engine

import kvnotes
from kvnotes import Document, Field
from kvnotes.core.errors import ArgumentTypeError, InvalidArgumentError, UnknownNameError
from kvnotes.core.repair import NO_REPAIR, REPAIR_SELECTORS, Repair, repair_selector, selectors_for

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


def test_bare_splice_with_skill_matches_recompute_on_tiny_model(tiny_llama):
    skill = tiny_llama.compile(POLICY, name="refunds")
    assert skill.positions[0] == 0 and skill.meta["anchor"] == "none"
    nb = tiny_llama.compose(["Customer asks about a refund. ", skill, " Answer:"], repair=0)
    stats = nb.meta["compose"]
    assert (stats["reused"], stats["computed"], stats["repaired"]) == (
        len(skill), len(nb) - len(skill), 0)
    assert nb.positions.tolist() == list(range(len(nb)))
    assert nb.span("refunds").end - nb.span("refunds").start == len(skill)
    report = kvnotes.fidelity(tiny_llama, ["Customer asks about a refund. ", skill, " Answer:"],
                              " yes", max_new_tokens=4, repair=0)
    assert report.tokens_reused == len(skill) and report.tokens_repaired == 0
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


# ---- anchored compilation, boundary repair (issue 14) ------------------------------------------
HEADER = "System: you are the support agent of a small shop.\n\n"
SECOND = "Shipping takes three days. Express shipping costs extra."


def _close(a, b, atol=1e-5):
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.positions, b.positions)
    for l in range(a.num_layers):
        assert torch.allclose(a.keys(l), b.keys(l), atol=atol)
        assert torch.allclose(a.values(l), b.values(l), atol=atol)


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def tiny(request, tokenizer):
    return make_tiny_engine(request.param, tokenizer)


@pytest.mark.parametrize("as_ids", [False, True])
def test_compile_after_keeps_true_positions_and_equals_prefill_with_prefix_dropped(tiny, as_ids):
    prefix = tiny.anchor_ids(HEADER)
    skill = tiny.compile(POLICY, after=prefix if as_ids else HEADER)
    assert skill.positions.tolist() == list(range(len(prefix), len(prefix) + len(skill)))
    assert skill.meta["after_tokens"] == len(prefix)
    full = tiny.prefill([*prefix, *tiny.encode(POLICY)])
    _close(skill, full.slice(len(prefix)), atol=1e-6)


def test_anchored_skill_right_after_its_header_composes_exactly(tiny):
    parts = [tiny.compile(HEADER), tiny.compile(POLICY, after=HEADER), " Answer:"]
    composed = tiny.compose(parts)
    _close(composed, tiny.prefill(composed.token_ids))
    # both skills sit where they were compiled, behind the very prefix: spliced as they are
    stats = composed.meta["compose"]
    assert stats["exact"] == [0, 1] and stats["regions"] == [] and stats["repaired"] == 0
    assert stats["reused"] == len(parts[0]) + len(parts[1])


def test_anchor_ids_with_token_ids_refuse_an_anchor(tiny):
    with pytest.raises(kvnotes.KvnotesError, match="token ids in after= are taken as given"):
        tiny.anchor_ids([1, 2], anchor="none")


@pytest.mark.parametrize("select", ["first", "kv_deviation"])
def test_compose_repair_all_equals_full_prefill(tiny, select):
    parts = ["Customer asks. ", tiny.compile(POLICY), " Then: ", tiny.compile(SECOND), " Answer:"]
    nb = tiny.compose(parts, repair=Repair(first=0, budget=1.0, select=select))
    _close(nb, tiny.prefill(nb.token_ids))
    stats = nb.meta["compose"]
    assert stats["reused"] == 0 and stats["repaired"] == len(parts[1]) + len(parts[3])
    assert stats["compute_fraction"] >= 1.0
    ref = tiny.next_logits(tiny.prefill(nb.token_ids), " yes")
    assert torch.allclose(tiny.next_logits(nb, " yes"), ref, atol=1e-4)


def test_compose_repair_zero_is_the_bare_splice_bit_for_bit(tiny):
    skill = tiny.compile(POLICY)
    parts = ["Customer asks. ", skill, " Answer:"]
    # the bare splice by hand: text prefilled, the skill re-rotated and appended, text on top
    bare = tiny.forward(tiny.empty(0), tiny.encode("Customer asks. ")).notebook.splice(skill)
    bare = tiny.forward(bare, tiny.encode(" Answer:")).notebook
    for repair in (0, 0.0, NO_REPAIR, Repair(first=0)):
        zero = tiny.compose(parts, repair=repair)
        _close(zero, bare, atol=0)
        stats = zero.meta["compose"]
        assert (stats["repaired"], stats["reused"], stats["regions"]) == (0, len(skill), [])
        assert stats["repair"] == "f0a1"


def test_compose_repair_budgets_int_and_float(tiny):
    a, b = tiny.compile(POLICY), tiny.compile(SECOND)
    spliced = len(a) + len(b)
    by_count = tiny.compose(["Q. ", a, b], repair=Repair(first=0, budget=3)).meta["compose"]
    assert by_count["repaired"] == 3 and by_count["reused"] == spliced - 3
    by_fraction = tiny.compose(["Q. ", a, b], repair=0.25).meta["compose"]
    assert by_fraction["repaired"] == math.ceil(0.25 * spliced)
    whole = Repair(first=0, budget=10_000)
    assert tiny.compose(["Q. ", a], repair=whole).meta["compose"]["repaired"] == len(a)
    # an int is each skill's first tokens, as the server reads it
    firsts = tiny.compose(["Q. ", a, b], repair=3).meta["compose"]
    at = len(tiny.encode("Q. "))
    assert firsts["regions"] == [[at, at + 3], [at + len(a), at + len(a) + 3]]
    assert firsts["repaired"] == 6 and firsts["repair"] == "f3a1"
    computed = by_fraction["computed"]
    assert by_fraction["compute_fraction"] == pytest.approx(
        (computed + by_fraction["repaired"]) / (computed + spliced))


def test_split_budget_is_proportional_and_capped():
    from kvnotes.core.repair import split_budget

    assert split_budget(10, [10, 40]) == [2, 8]
    assert split_budget(5, [10, 20]) == [2, 3]  # 1.67 / 3.33: the larger remainder first
    assert split_budget(3, [1, 1, 100]) == [0, 0, 3]
    assert split_budget(5, [2, 2]) == [2, 2]
    assert split_budget(0, [4]) == [0]


@pytest.mark.parametrize("bad,error,message", [
    (-1, InvalidArgumentError, r"Repair\(first=-1\): give a token count >= 0"),
    (1.5, InvalidArgumentError, r"repair=1\.5 is not a fraction in \(0, 1\]"),
    (float("nan"), InvalidArgumentError, r"repair=nan is not a fraction"),
    ("0.1", ArgumentTypeError, r"repair must be a Repair, a token count .* got '0.1' \(str\)"),
    (True, ArgumentTypeError, r"repair must be a Repair, a token count .* got True \(bool\)"),
])
def test_compose_bad_repair_budgets_raise(tiny_llama, bad, error, message):
    skill = tiny_llama.compile(POLICY)
    with pytest.raises(error, match=message):
        tiny_llama.compose(["Q. ", skill], repair=bad)


def test_a_repair_with_an_unknown_selector_lists_the_valid_ones():
    with pytest.raises(UnknownNameError) as err:
        Repair(budget=0.5, select="random")
    assert str(err.value) == ("unknown repair selector 'random'; valid repair selectors: first, "
                              "kv_deviation (attention applies to edit only)")


def test_one_repair_selector_vocabulary():
    assert list(REPAIR_SELECTORS) == ["first", "attention", "kv_deviation"]
    assert selectors_for("compose") == ("first", "kv_deviation")
    assert selectors_for("edit") == ("attention", "kv_deviation")
    assert repair_selector("attention", "edit") == "attention"
    with pytest.raises(UnknownNameError, match=r"attention applies to edit only; in 'x:attention'"):
        repair_selector("attention", "compose", "in 'x:attention'")
    with pytest.raises(UnknownNameError, match="unknown repair operation 'trace'"):
        selectors_for("trace")


def test_recompute_every_index_equals_prefill_and_leaves_input(tiny):
    composed = tiny.compose(["Q. ", tiny.compile(POLICY)])
    before = composed.keys(0).clone()
    again = tiny.recompute(composed, range(len(composed)))
    _close(again, tiny.prefill(composed.token_ids))
    assert torch.equal(composed.keys(0), before)  # the input notebook is untouched
    n = len(composed)
    with pytest.raises(InvalidArgumentError, match=rf"recompute indices must be token indices "
                       rf"in \[0, {n}\) of a notebook of {n} tokens; got 1 out of range "
                       rf"\({n}\)$") as err:
        tiny.recompute(composed, [0, n])
    assert isinstance(err.value, kvnotes.KvnotesError) and not isinstance(err.value, IndexError)
    with pytest.raises(InvalidArgumentError, match=rf"got 2 out of range \(-1\.\.{n + 3}\)"):
        tiny.recompute(composed, torch.tensor([-1, 2, n + 3]))


def test_repair_choice_picks_spliced_notes_and_refuses_bad_arguments(tiny):
    nb = tiny.compose(["Q. ", tiny.compile(POLICY)])
    at = len(nb) - 4
    assert tiny.repair_choice(nb, at, 2) == ([at, at + 1], 0.0)
    chosen, cost = tiny.repair_choice(nb, at, 2, select="kv_deviation", layer=1)
    assert len(chosen) == 2 and chosen == sorted(chosen) and all(at <= i < len(nb) for i in chosen)
    assert cost == pytest.approx(4 * 2 / tiny.adapter.num_layers)
    with pytest.raises(UnknownNameError, match="repair selector"):
        tiny.repair_choice(nb, at, 1, select="nope")
    with pytest.raises(InvalidArgumentError, match=r"got at=.*, k=5"):
        tiny.repair_choice(nb, at, 5)


def test_engine_has_no_edit_method():
    # editing is kvnotes.edit(engine, nb, ...) in the ops layer; the engine knows nothing of it
    assert not hasattr(kvnotes.Engine, "edit")
    assert kvnotes.edit.__module__ == "kvnotes.ops.edit"
