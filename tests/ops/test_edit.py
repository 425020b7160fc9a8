"""Editing fields of prefilled documents: every strategy against full recompute."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_engine

from kvnotes import Document, Field
from kvnotes.core.compose import _runs
from kvnotes.core.errors import EmptyInputError, NotebookMismatchError, UnknownFieldError, UnknownNameError
from kvnotes.ops.edit import (
    ERRATUM_TEMPLATES,
    EditReport,
    edit,
    erratum_text,
    erratum_turn,
    field_label,
)

BODY = ("\nCustomer: Maria Alvarez\nItems: a desk lamp and a backpack\nTotal: $84.20\n"
        "Refunds are possible only while the order is pending; shipped or delivered orders "
        "must be returned first. Agents decide from the status above.\n")


def doc(status: str = "pending") -> Document:
    return Document(["ORDER #4411\nOrder status: ", Field("status", status), BODY])


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def engine(request, tokenizer):
    return make_tiny_engine(request.param, tokenizer)


def logits_after(engine, nb, query="\nRefund? Answer:"):
    return engine.next_logits(nb, query)


def test_prefill_remembers_the_document(engine):
    nb = engine.prefill(doc())
    assert nb.meta["document"]["parts"][1] == ["field", "status", "pending"]
    assert nb.fields == ["status"]


def test_recompute_is_prefill_of_the_new_document(engine):
    nb = engine.prefill(doc())
    new, report = edit(engine, nb, "status", "delivered", strategy="recompute")
    ref = engine.prefill(doc("delivered"))
    assert torch.equal(new.token_ids, ref.token_ids)
    torch.testing.assert_close(logits_after(engine, new), logits_after(engine, ref))
    assert report.tokens_recomputed == len(ref) and report.compute_fraction == 1.0
    assert new.meta["document"]["parts"][1] == ["field", "status", "delivered"]
    assert nb.meta["document"]["parts"][1] == ["field", "status", "pending"]  # old untouched


@pytest.mark.parametrize("value", ["shipped", "partially refunded and closed"])
def test_prefix_matches_recompute(engine, value):
    nb = engine.prefill(doc())
    pre, report = edit(engine, nb, "status", value, strategy="prefix")
    ref, _ = edit(engine, nb, "status", value, strategy="recompute")
    torch.testing.assert_close(logits_after(engine, pre), logits_after(engine, ref),
                               rtol=1e-4, atol=1e-4)
    assert report.tokens_reused == nb.span("status").start
    assert report.tokens_recomputed + report.tokens_reused == len(ref)


def test_overwrite_equal_length_keeps_downstream_bit_identical(engine):
    nb = engine.prefill(doc("pending"))
    f = nb.span("status")
    value = next(v for v in ("closed", "open", "late", "shipped", "delivered")
                 if len(engine.encode(v)) == len(f))
    new, report = edit(engine, nb, "status", value, strategy="overwrite")
    assert report.tokens_recomputed == len(f) and report.delta == 0
    assert torch.equal(new.positions, nb.positions)
    for layer in range(engine.adapter.num_layers):
        assert torch.equal(new.keys(layer)[..., f.end:, :], nb.keys(layer)[..., f.end:, :])
        assert torch.equal(new.values(layer)[..., f.end:, :], nb.values(layer)[..., f.end:, :])
        assert torch.equal(new.keys(layer)[..., :f.start, :], nb.keys(layer)[..., :f.start, :])
        assert not torch.equal(new.keys(layer)[..., f.start:f.end, :],
                               nb.keys(layer)[..., f.start:f.end, :])
    # the field's own notes are what a recompute writes
    ref = engine.prefill(doc(value))
    torch.testing.assert_close(new.keys(0)[..., :f.end, :], ref.keys(0)[..., :f.end, :])


def test_overwrite_length_change_shifts_downstream(engine):
    nb = engine.prefill(doc("pending"))
    f = nb.span("status")
    value = "partially refunded and closed"
    new, report = edit(engine, nb, "status", value, strategy="overwrite")
    delta = len(engine.encode(value)) - len(f)
    assert delta > 0 and report.delta == delta and len(new) == len(nb) + delta
    assert torch.equal(new.positions, torch.arange(len(new)))  # contiguous
    assert new.span("status").end == f.end + delta
    moved = nb.slice(f.end).shifted(delta)
    for layer in range(engine.adapter.num_layers):
        assert torch.equal(new.keys(layer)[..., f.end + delta:, :], moved.keys(layer))
        assert torch.equal(new.values(layer)[..., f.end + delta:, :],
                           nb.values(layer)[..., f.end:, :])
    shorter, _ = edit(engine, new, "status", "open", strategy="overwrite")
    assert torch.equal(shorter.positions, torch.arange(len(shorter)))


def test_erratum_keeps_the_old_notebook_as_exact_prefix(engine):
    nb = engine.prefill(doc())
    new, report = edit(engine, nb, "status", "delivered", strategy="erratum")
    n = len(nb)
    assert torch.equal(new.token_ids[:n], nb.token_ids)
    assert torch.equal(new.positions[:n], nb.positions)
    for layer in range(engine.adapter.num_layers):
        assert torch.equal(new.keys(layer)[..., :n, :], nb.keys(layer))
        assert torch.equal(new.values(layer)[..., :n, :], nb.values(layer))
    span = new.spans[-1]
    assert span.kind == "erratum" and span.end == len(new)
    assert "delivered" in engine.decode(new.token_ids[n:])
    assert report.tokens_appended == len(new) - n and report.tokens_recomputed == 0
    assert new.meta["errata"] == [{"field": "status", "value": "delivered"}]


def test_erratum_templates_and_chat_turns(engine):
    text = erratum_turn(engine, "order status", "pending", "delivered", template="update")
    assert "changed from pending to delivered" in text
    assert text.startswith("<|im_start|>user")  # the SmolLM2 tokenizer has a chat template
    plain = erratum_turn(engine, "order status", "pending", "delivered", chat=False)
    assert plain == "\n\nCorrection: the order status is delivered, not pending.\n"
    assert erratum_text("order status", "pending", "delivered") == plain.strip()
    custom = erratum_text("x", "a", "b", template="Now {label}={new}")
    assert custom == "Now x=b"
    with pytest.raises(UnknownNameError) as err:
        erratum_text("x", "a", "b", template="nope")
    assert str(err.value) == ("unknown erratum template 'nope'; valid erratum templates: "
                              "correction, update, strong, restate (or a format string with {new})")
    assert err.value.valid == tuple(ERRATUM_TEMPLATES) and isinstance(err.value, ValueError)
    assert set(ERRATUM_TEMPLATES) >= {"correction", "update", "strong", "restate"}
    assert field_label(doc(), "status") == "order status"


@pytest.mark.parametrize("select", ["attention", "kv_deviation"])
def test_repair_with_all_downstream_equals_prefix(engine, select):
    nb = engine.prefill(doc())
    rep, report = edit(engine, nb, "status", "delivered", strategy="repair", k=10_000,
                              select=select)
    pre, _ = edit(engine, nb, "status", "delivered", strategy="prefix")
    torch.testing.assert_close(logits_after(engine, rep), logits_after(engine, pre),
                               rtol=1e-4, atol=1e-4)
    assert report.tokens_reused == nb.span("status").start
    assert report.select == select and report.select_tokens > 0


@pytest.mark.parametrize("select", ["attention", "kv_deviation"])
def test_repair_budget_k(engine, select):
    nb = engine.prefill(doc())
    over, _ = edit(engine, nb, "status", "delivered", strategy="overwrite")
    zero, r0 = edit(engine, nb, "status", "delivered", strategy="repair", k=0, select=select)
    torch.testing.assert_close(logits_after(engine, zero), logits_after(engine, over))
    some, r5 = edit(engine, nb, "status", "delivered", strategy="repair", k=5, select=select)
    assert r5.tokens_recomputed == r0.tokens_recomputed + 5
    assert torch.equal(some.positions, torch.arange(len(some)))
    assert 0 < r5.compute_fraction < 0.5


def test_edit_after_extend_keeps_the_tail(engine):
    nb = engine.extend(engine.prefill(doc()), "\nNote: customer called twice.", name="note")
    pre, _ = edit(engine, nb, "status", "partially refunded and closed", strategy="prefix")
    ref, _ = edit(engine, nb, "status", "partially refunded and closed", strategy="recompute")
    assert torch.equal(pre.token_ids, ref.token_ids)
    assert pre.span("note").end == len(pre)
    torch.testing.assert_close(logits_after(engine, pre), logits_after(engine, ref),
                               rtol=1e-4, atol=1e-4)


def test_clear_errors(engine, tokenizer):
    nb = engine.prefill(doc())
    with pytest.raises(UnknownFieldError, match=r"unknown field 'state'; this document has "
                                                r"fields: \['status'\]"):
        edit(engine, nb, "state", "delivered", strategy="prefix")
    with pytest.raises(EmptyInputError, match="the new value for field 'status' is empty"):
        edit(engine, nb, "status", "", strategy="overwrite")
    other = make_tiny_engine("qwen2", tokenizer)
    with pytest.raises(NotebookMismatchError, match="cannot edit a notebook with a different"):
        edit(other, nb, "status", "delivered", strategy="recompute")
    with pytest.raises(UnknownNameError) as err:
        edit(engine, nb, "status", "delivered", strategy="magic")
    assert str(err.value) == ("unknown strategy 'magic'; valid strategies: recompute, prefix, "
                              "overwrite, erratum, repair")
    with pytest.raises(UnknownNameError) as err:
        edit(engine, nb, "status", "delivered", strategy="repair", select="random")
    assert str(err.value) == ("unknown repair selector 'random'; valid repair selectors: "
                              "attention, kv_deviation (first applies to compose only)")
    with pytest.raises(UnknownNameError, match=r"'first'; .* \(first applies to compose only\)$"):
        edit(engine, nb, "status", "delivered", strategy="repair", select="first")
    with pytest.raises(Exception, match="does not remember a document"):
        edit(engine, engine.prefill("Order status: pending"), "status", "x")


def test_report_and_helpers():
    r = EditReport("prefix", "f", "a", "b", tokens_total=100, tokens_recomputed=25,
                   tokens_reused=75)
    assert r.compute_fraction == 0.25 and r.to_dict()["compute_fraction"] == 0.25
    assert _runs([3, 4, 5, 9, 11, 12]) == [(3, 6), (9, 10), (11, 13)]


# ---- real models --------------------------------------------------------------------------------
@pytest.mark.real
def test_real_model_edits(real_engine):
    from kvnotes.eval.tasks import load_suite
    from kvnotes.research.edit.cases import case_prompt

    case = load_suite(["membership"])[0]
    doc_, query = case_prompt(real_engine, case)
    nb = real_engine.prefill(doc_)
    pre, _ = edit(real_engine, nb, case.field, case.new_value, strategy="prefix")
    ref, _ = edit(real_engine, nb, case.field, case.new_value, strategy="recompute")
    torch.testing.assert_close(real_engine.next_logits(pre, query),
                               real_engine.next_logits(ref, query), rtol=1e-3, atol=1e-3)
    err, _ = edit(real_engine, nb, case.field, case.new_value, strategy="erratum")
    assert torch.equal(err.keys(0)[..., :len(nb), :], nb.keys(0))
    assert "Correction: the membership tier is" in real_engine.decode(err.token_ids[len(nb):])
