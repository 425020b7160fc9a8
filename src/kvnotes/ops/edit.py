"""Editing a field of a prefilled document: recompute, prefix, overwrite, erratum and repair.

A notebook prefilled from a :class:`~kvnotes.Document` remembers that document
(``nb.meta["document"]``), so :func:`edit` knows where the field's tokens sit. Every strategy
returns a *new* notebook and an :class:`EditReport`; the input notebook is never changed.

Strategies (positions are always explicit; keys are stored post-RoPE):

- ``recompute`` -- prefill the edited document from scratch (the reference).
- ``prefix`` -- keep the exact prefix up to the first changed token, recompute the rest
  (prefix caching as vLLM/SGLang do it; equal to ``recompute`` up to float error).
- ``overwrite`` -- recompute only the field's tokens on top of the prefix and keep every
  downstream note; when the value's token length changes, the downstream notes are moved with
  :meth:`Notebook.shifted` so positions stay contiguous.
- ``erratum`` -- keep the notebook as it is and append a salient correction (append-only: the
  old notebook is an exact prefix of the new one). Chat models get it as a new user turn.
- ``repair`` -- ``overwrite``, then recompute the ``k`` downstream tokens the field affects most,
  chosen by attention mass to the field (``select="attention"``) or by KV deviation at an early
  layer (``select="kv_deviation"``, as CacheBlend does). Selected tokens are recomputed in order,
  each seeing every earlier note (recomputed or kept); ``k`` = all downstream tokens is
  ``prefix``.

Decisions (:func:`decide`): without chain of thought, the answer whose first token has the
highest logit at the decision position; with ``cot=True``, greedy reasoning up to a budget and
the answer parsed from the text.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import computed_field
from pydantic.dataclasses import dataclass as record

from kvnotes.core import validate
from kvnotes.core.chat import chat_turn, has_template
from kvnotes.core.document import Document, Field, document_meta, remembered_document
from kvnotes.core.engine import Engine
from kvnotes.core.errors import EmptyInputError, KvnotesError, UnknownNameError
from kvnotes.core.meta import Erratum, NotebookMeta
from kvnotes.core.notebook import Notebook, Span
from kvnotes.core.records import JsonRecord
from kvnotes.core.repair import repair_budget, repair_selector

STRATEGIES = ("recompute", "prefix", "overwrite", "erratum", "repair")

# Erratum wordings; {label}, {Label}, {old}, {new} are filled in. Measured by `kvnotes edit
# --strategies erratum:<name>`; "correction" is the default.
ERRATUM_TEMPLATES: dict[str, str] = {
    "correction": "Correction: the {label} is {new}, not {old}.",
    "update": "Update: the {label} has changed from {old} to {new}.",
    "strong": ("IMPORTANT CORRECTION: the {label} in the record above is wrong. The correct "
               "{label} is {new} (not {old}). Use {new} for every decision."),
    "restate": "{Label}: {new}",
}
DEFAULT_ERRATUM = "correction"


@record(frozen=True, slots=True)
class EditReport(JsonRecord):
    """What an edit did and what it cost.

    ``tokens_total`` is what a full recompute of the edited notebook computes; the compute
    fraction is ``(tokens_recomputed + tokens_appended) / tokens_total``. ``select_tokens`` is the
    token-equivalent work of choosing repair tokens (an early-layer pass for ``kv_deviation``;
    for ``attention`` an instrumented pass standing in for statistics a serving system would
    record at prefill) and is kept apart.
    """

    strategy: str
    field: str
    old_value: str
    new_value: str
    tokens_total: int
    tokens_recomputed: int
    tokens_reused: int
    tokens_appended: int = 0
    select: str | None = None
    k: int | None = None
    select_tokens: float = 0.0
    select_seconds: float = 0.0
    seconds: float = 0.0
    delta: int = 0  # change of the field's token length

    @computed_field  # type: ignore[prop-decorator]
    @property
    def compute_fraction(self) -> float:
        return (self.tokens_recomputed + self.tokens_appended) / max(1, self.tokens_total)


# ---- planning ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Plan:
    """Where the edit lands, in old and new token indices."""

    doc: Document
    new_doc: Document
    offset: int
    fs: int  # field start (same in old and new)
    fe_old: int
    fe_new: int
    old_ids: list[int]  # the whole old notebook
    new_ids: list[int]  # the whole edited sequence
    new_spans: list[Span]
    first_change: int

    @property
    def delta(self) -> int:
        return self.fe_new - self.fe_old


def _plan(engine: Engine, nb: Notebook, field: str, new_value: str) -> _Plan:
    nb.check_same_model(engine.fingerprint, what="edit a notebook with")
    doc, offset = remembered_document(nb.meta)
    doc.value(field)  # unknown field: the error lists the document's fields
    if not new_value or not engine.encode(new_value):
        raise EmptyInputError(f"the new value for field {field!r} is empty; give a value with at "
                              "least one token")
    old_doc_ids, old_raw = doc.tokenize(engine.tokenizer)
    old_ids = [int(t) for t in nb.token_ids.tolist()]
    if old_ids[offset:offset + len(old_doc_ids)] != old_doc_ids:
        raise KvnotesError("this notebook no longer holds the document it remembers at index "
                           f"{offset}; edit the notebook the document was prefilled into")
    new_doc = doc.with_value(field, new_value)
    new_doc_ids, new_raw = new_doc.tokenize(engine.tokenizer)
    fs_doc, fe_doc = next((s, e) for n, k, s, e in old_raw if k == "field" and n == field)
    fe_new_doc = next(e for n, k, s, e in new_raw if k == "field" and n == field)
    fs, fe_old, fe_new = offset + fs_doc, offset + fe_doc, offset + fe_new_doc
    delta = fe_new - fe_old
    new_ids = [*old_ids[:fs], *new_doc_ids[fs_doc:fe_new_doc], *old_ids[fe_old:]]
    first = next((i for i, (a, b) in enumerate(zip(old_ids, new_ids, strict=False)) if a != b),
                 min(len(old_ids), len(new_ids)))
    if len(old_ids) == len(new_ids) and first == len(old_ids):
        first = len(new_ids)
    return _Plan(doc, new_doc, offset, fs, fe_old, fe_new, old_ids, new_ids,
                 _edited_spans(nb.spans, fs, fe_old, delta, field), first)


def _edited_spans(spans: Sequence[Span], fs: int, fe: int, delta: int, field: str) -> list[Span]:
    out = []
    for s in spans:
        if s.end <= fs:
            out.append(s)
        elif s.start >= fe:
            out.append(s.moved(delta))
        else:  # a span covering the field (the field itself, or a span around it)
            out.append(Span(s.name, s.kind, s.start, s.end + delta))
    return out


def _finish(engine: Engine, nb: Notebook, plan: _Plan, field: str) -> Notebook:
    meta: NotebookMeta = {**nb.meta, "document": document_meta(plan.new_doc, plan.offset)}
    return Notebook(nb.layers, nb.token_ids, nb.positions, plan.new_spans, nb.adapter,
                    nb.fingerprint, meta=meta, origin=nb.start_position)


# ---- strategies -------------------------------------------------------------------------------
def _recompute(engine: Engine, nb: Notebook, plan: _Plan) -> tuple[Notebook, int, int]:
    out = engine.forward(engine.empty(nb.start_position), plan.new_ids).notebook
    return out, len(plan.new_ids), 0


def _prefix(engine: Engine, nb: Notebook, plan: _Plan) -> tuple[Notebook, int, int]:
    p = plan.first_change
    head = nb.slice(0, p)
    out = engine.forward(head, plan.new_ids[p:]).notebook if p < len(plan.new_ids) else head
    return out, len(plan.new_ids) - p, p


def _overwrite(engine: Engine, nb: Notebook, plan: _Plan) -> tuple[Notebook, int, int]:
    head = engine.forward(nb.slice(0, plan.fs), plan.new_ids[plan.fs:plan.fe_new]).notebook
    tail = nb.slice(plan.fe_old)
    if len(tail):
        tail = tail.shifted(plan.delta)
        out = Notebook.concat([head, tail])
    else:
        out = head
    reused = len(plan.new_ids) - (plan.fe_new - plan.fs)
    return out, plan.fe_new - plan.fs, reused


def erratum_text(label: str, old: str, new: str, *, template: str = DEFAULT_ERRATUM) -> str:
    """The wording of a correction: ``template`` names one of :data:`ERRATUM_TEMPLATES` or is a
    format string with ``{new}`` (and optionally ``{label}``, ``{Label}``, ``{old}``).

    Example:
        >>> erratum_text("order status", "pending", "delivered")
        'Correction: the order status is delivered, not pending.'
    """
    fmt = ERRATUM_TEMPLATES.get(template, template)
    if "{new}" not in fmt:
        raise UnknownNameError("erratum template", template, ERRATUM_TEMPLATES,
                               "or a format string with {new}")
    validate.erratum_template(fmt)
    return fmt.format(label=label, Label=label[:1].upper() + label[1:], old=old, new=new)


def erratum_turn(engine: Engine, label: str, old: str, new: str, *,
                 template: str = DEFAULT_ERRATUM, chat: bool | None = None) -> str:
    """:func:`erratum_text` as the ``erratum`` strategy appends it to a notebook.

    Chat models (``chat=None`` and a tokenizer with a chat template) get it as a new user turn;
    base models get it as a paragraph of its own.
    """
    text = erratum_text(label, old, new, template=template)
    use_chat = has_template(engine.tokenizer) if chat is None else chat
    return chat_turn(engine.tokenizer, "user", text) if use_chat else f"\n\n{text}\n"


def field_label(doc: Document, field: str) -> str:
    """A readable name for ``field``: the words right before it ("Order status: " -> "order
    status"), else the field name."""
    before = ""
    for part in doc.parts:
        if isinstance(part, Field):
            if part.name == field:
                break
            before = ""
        else:
            before += part
    line = before.rsplit("\n", 1)[-1].strip().rstrip(":").strip()
    label = line if line and len(line) <= 40 else field.replace("_", " ")
    return label[:1].lower() + label[1:] if label[1:2].islower() or len(label) == 1 else label


def _erratum(engine: Engine, nb: Notebook, plan: _Plan, field: str, template: str,
             chat: bool | None, label: str | None) -> tuple[Notebook, int]:
    text = erratum_turn(engine, label or field_label(plan.doc, field), plan.doc.value(field),
                        plan.new_doc.value(field), template=template, chat=chat)
    ids = engine.encode(text)
    out = engine.forward(nb, ids, spans=[Span(f"erratum:{field}", "erratum", 0, len(ids))]).notebook
    return out, len(ids)


# ---- repair: selection and selective recompute --------------------------------------------------
@torch.inference_mode()
def attention_scores(engine: Engine, nb: Notebook, fs: int, fe: int) -> torch.Tensor:
    """FloatTensor[n - fe]: attention mass each token after the field puts on the field's tokens
    at prefill (summed over field tokens, averaged over heads and layers)."""
    out = engine.forward(nb.slice(0, fs), nb.token_ids[fs:], attentions=True).output
    if not out.attentions or any(a is None for a in out.attentions):
        raise KvnotesError("this model returns no attention weights; use select='kv_deviation'")
    total = torch.zeros(len(nb) - fe)
    for weights in out.attentions:  # [1, heads, q, fs + q]
        rows = weights[0, :, fe - fs:, fs:fe].float()  # [heads, n - fe, field]
        total += rows.sum(-1).mean(0).cpu()
    return total / len(out.attentions)


@dataclass(frozen=True, slots=True)
class _Repaired:
    """What the ``repair`` strategy did: the notebook, the notes recomputed and kept, and the
    selection's cost (token-equivalents, seconds, and the seconds a memoized selection did not
    spend now but is charged)."""

    notebook: Notebook
    computed: int
    reused: int
    select_tokens: float
    select_seconds: float
    unpaid: float


def _repair(engine: Engine, nb: Notebook, plan: _Plan, k: int, select: str, layer: int,
            memo: dict[Any, Any] | None) -> _Repaired:
    repair_selector(select, "edit")
    base, _, _ = _overwrite(engine, nb, plan)
    n = len(plan.new_ids)
    down = plan.fe_new
    k = repair_budget(k, n - down)  # a token count, capped at the downstream tokens
    t0 = time.perf_counter()
    key = (select, layer, plan.fs, tuple(plan.new_ids))
    if k == 0:
        scores, select_tokens = torch.zeros(n - down), 0.0
    elif memo is not None and key in memo:
        scores, select_tokens = memo[key]
    elif select == "attention":
        scores = attention_scores(engine, nb, plan.fs, plan.fe_old)
        select_tokens = float(len(nb) - plan.fs)
    else:
        # the edited tokens on top of the unchanged head, compared at `layer` from the field on
        scores = engine.note_deviation(base, plan.fs, layer)[down - plan.fs:]
        select_tokens = (n - plan.fs) * (layer + 1) / engine.adapter.num_layers
    paid = time.perf_counter() - t0
    select_seconds = paid
    if memo is not None and k:
        select_seconds = memo.setdefault(("seconds", *key), paid)
        memo[key] = (scores, select_tokens)
    chosen = (torch.topk(scores, k).indices + down).tolist() if k else []
    recompute = sorted({*range(plan.fs, plan.fe_new), *chosen})
    out = engine.recompute(base, recompute)  # the one selective-recompute step (compose's too)
    # a memoized selection is charged as if run again
    return _Repaired(out, len(recompute), n - len(recompute), select_tokens, select_seconds,
                     select_seconds - paid)


# ---- the entry point ---------------------------------------------------------------------------
def edit(engine: Engine, nb: Notebook, field: str, new_value: str, strategy: str = "erratum", *,
         k: int = 32, select: str = "attention", layer: int = 1,
         template: str = DEFAULT_ERRATUM, chat: bool | None = None,
         label: str | None = None, memo: dict[Any, Any] | None = None
         ) -> tuple[Notebook, EditReport]:
    """Set ``field`` to ``new_value`` in a notebook prefilled from a Document.

    Args:
        engine: the engine whose model wrote ``nb``.
        nb: a notebook from ``engine.prefill(document)`` (possibly extended since).
        field: the field's name in the document.
        new_value: the new value (at least one token).
        strategy: one of ``recompute``, ``prefix``, ``overwrite``, ``erratum``, ``repair``.
        k: ``repair`` budget, the number of downstream tokens recomputed besides the field.
        select: ``repair`` selection, a repair selector that edits take
            (:data:`~kvnotes.core.repair.REPAIR_SELECTORS`): ``"attention"`` or
            ``"kv_deviation"``.
        layer: the early layer ``kv_deviation`` compares at (1 = the second layer).
        template: ``erratum`` wording: a name in :data:`ERRATUM_TEMPLATES` or a format string.
        chat: ``erratum`` as a chat turn (None: when the tokenizer has a chat template).
        label: how the erratum names the field (default: the words before it in the document).
        memo: a dict to keep ``repair`` selection scores in, so several budgets ``k`` for the
            same notebook and edit choose from one selection pass (its seconds are reported
            with every repair that uses it, as if each had paid for it).

    Returns:
        ``(new_notebook, report)``; ``nb`` is left as it was.

    Example:
        >>> doc = Document(["Status: ", Field("status", "pending"), "."])
        >>> nb = engine.prefill(doc)                                      # doctest: +SKIP
        >>> new, report = edit(engine, nb, "status", "done", strategy="prefix")  # doctest: +SKIP
    """
    validate.edit_args(engine, nb, field, new_value, k=k, layer=layer, chat=chat)
    if strategy not in STRATEGIES:
        raise UnknownNameError("strategy", strategy, STRATEGIES)
    t0 = time.perf_counter()
    plan = _plan(engine, nb, field, new_value)
    old_value = plan.doc.value(field)
    extra: dict[str, Any] = {}
    if strategy == "erratum":
        out, appended = _erratum(engine, nb, plan, field, template, chat, label)
        seconds = time.perf_counter() - t0
        errata: list[Erratum] = [*nb.meta.get("errata", []),
                                 {"field": field, "value": new_value}]
        out = out.with_meta(errata=errata)
        report = EditReport(strategy, field, old_value, new_value, len(plan.new_ids) + appended,
                            0, len(nb), tokens_appended=appended, seconds=seconds,
                            delta=plan.delta)
        return out, report
    if strategy == "recompute":
        out, computed, reused = _recompute(engine, nb, plan)
    elif strategy == "prefix":
        out, computed, reused = _prefix(engine, nb, plan)
    elif strategy == "overwrite":
        out, computed, reused = _overwrite(engine, nb, plan)
    else:
        done = _repair(engine, nb, plan, k, select, layer, memo)
        out, computed, reused = done.notebook, done.computed, done.reused
        t0 -= done.unpaid
        extra = dict(select=select, k=k, select_tokens=done.select_tokens,
                     select_seconds=done.select_seconds)
    out = _finish(engine, out, plan, field)
    seconds = time.perf_counter() - t0
    report = EditReport(strategy, field, old_value, new_value, len(plan.new_ids), computed,
                        reused, seconds=seconds, delta=plan.delta, **extra)
    return out, report
