"""The first token(s) of an answer, the space rule, the decision type and the one answer parser."""

from __future__ import annotations

import pytest
import torch

from kvnotes.core.errors import AnswerTokenError, EmptyAnswerError, KvnotesError
from kvnotes.ops.decisions import (
    Decision,
    answer_ids,
    decide,
    first_token_ids,
    guarded,
    leading_space,
    margin_of,
    parse_answer,
)


def test_space_rule():
    assert leading_space("Answer:") and leading_space("Decision:")
    assert not leading_space("<|im_start|>assistant\n") and not leading_space("")


def test_answer_ids_follow_the_space_rule(tiny_llama):
    enc = tiny_llama.encode
    assert answer_ids(tiny_llama, "yes", after="Answer:") == enc(" yes")
    assert answer_ids(tiny_llama, " yes", after="Answer:") == enc(" yes")  # own space dropped
    assert answer_ids(tiny_llama, "yes", after="assistant\n") == enc("yes")
    assert first_token_ids(tiny_llama, ["yes", 7], after="Answer:") == [enc(" yes")[0], 7]


def test_empty_and_indistinguishable_answers_are_clear_errors(tiny_llama):
    with pytest.raises(EmptyAnswerError, match=r"^answer ' ' has no tokens; decisions read an "
                                               r"answer's first token"):
        answer_ids(tiny_llama, " ", after="Answer:")
    with pytest.raises(AnswerTokenError, match=r"^answers \['yes', 'yes sir'\] share their first "
                                               r"token ' yes'; .*start differently$"):
        first_token_ids(tiny_llama, ["yes", "yes sir"], after="Answer:")
    assert issubclass(EmptyAnswerError, KvnotesError) and issubclass(AnswerTokenError, ValueError)


def test_trace_uses_the_same_answer_tokens(tiny_llama):
    from kvnotes.ops.trace import answer_token_ids

    ids = answer_token_ids(tiny_llama, "Refund? Answer:", ("yes", "no"))
    assert list(ids) == first_token_ids(tiny_llama, ["yes", "no"], after="Answer:")
    with pytest.raises(EmptyAnswerError):  # was an IndexError in one of the old copies
        answer_token_ids(tiny_llama, "Refund? Answer:", ("yes", ""))


def test_decide_reads_first_token_logits(tiny_llama):
    engine = tiny_llama
    nb = engine.prefill("ORDER #4411\nOrder status: pending\nRefunds only while pending.")
    d = decide(engine, nb, "\nRefund? Answer:", ("yes", "no"))
    assert d.answer in ("yes", "no") and set(d.scores) == {"yes", "no"}
    assert d.answer == max(d.scores, key=d.scores.__getitem__)
    assert d.margin == pytest.approx(abs(d.scores["yes"] - d.scores["no"]))
    c = decide(engine, nb, "\nRefund? Answer:", ("yes", "no"), cot=True, budget=4)
    torch.testing.assert_close(c.logits, d.logits)


def test_decision_and_margin():
    d = Decision("yes", {"yes": 2.0, "no": 0.5}, margin_of([2.0, 0.5]))
    assert d.margin == 1.5 and d.logits is None and d.text == ""
    assert margin_of([1.0]) != margin_of([1.0])  # nan: no runner-up


@pytest.mark.parametrize("text,want", [
    ("Both yes and no matter. Final answer: no.", "no"), ("Yes, it can.", "yes"),
    ("Answer: YES", "yes"), ("No. Yes.", "no"), ("yesterday", None), ("", None),
])
def test_parse_answer(text, want):
    assert parse_answer(text, ("yes", "no")) == want


# ---- guarded decisions (issue 14) ---------------------------------------------------------------
POLICY = "Refunds are issued within five days. Final-sale items cannot be returned."


def _composed(engine):
    return engine.compose(["Customer asks for a refund. ", engine.compile(POLICY), " Policy ends."])


def test_guard_fires_below_tau_and_redecides_on_exact_notes(tiny_llama):
    nb = _composed(tiny_llama)
    query, answers = " Refund? Answer:", ("yes", "no")
    fast = decide(tiny_llama, nb, query, answers)
    d = decide(tiny_llama, nb, query, answers, guard=fast.margin + 1.0)
    assert d.guard is not None and d.guard.fired
    assert d.guard.fast_answer == fast.answer and d.guard.fast_margin == pytest.approx(fast.margin)
    assert d.guard.tokens == len(nb) + len(tiny_llama.encode(query))
    exact = decide(tiny_llama, tiny_llama.prefill(nb.token_ids), query, answers)
    assert d.answer == exact.answer == d.guard.exact_answer
    assert d.margin == pytest.approx(exact.margin, abs=1e-4)  # the result is the exact one
    assert d.guard.to_dict()["changed"] == (fast.answer != exact.answer)


def test_guard_stays_quiet_above_tau(tiny_llama):
    nb = _composed(tiny_llama)
    fast = decide(tiny_llama, nb, " Refund? Answer:", ("yes", "no"))
    d = decide(tiny_llama, nb, " Refund? Answer:", ("yes", "no"), guard=fast.margin / 2)
    assert d.guard is not None and not d.guard.fired and d.guard.tokens == 0
    assert d.answer == fast.answer and d.margin == fast.margin


def test_guard_needs_a_margin_at_least_zero(tiny_llama):
    with pytest.raises(KvnotesError, match=r"guard tau must be a margin >= 0, got -1"):
        decide(tiny_llama, _composed(tiny_llama), " Answer:", ("yes", "no"), guard=-1)


def test_guard_redoes_only_what_is_not_exact(tiny_llama):
    nb = _composed(tiny_llama)
    decide_on = lambda n: decide(tiny_llama, n, " Refund? Answer:", ("yes", "no"))  # noqa: E731
    exact_already, same = guarded(tiny_llama, nb, decide_on, tau=1e9, exact_from=len(nb))
    assert not exact_already.guard.fired and same is nb  # nothing inexact: nothing redone
    d, redone = guarded(tiny_llama, nb, decide_on, tau=1e9, exact_from=3)
    assert d.guard.fired and d.guard.tokens == len(nb) - 3
    full = tiny_llama.prefill(nb.token_ids)
    assert torch.allclose(redone.keys(1), full.keys(1), atol=1e-5)
