"""The serve-bench workload: long sessions, streams of field edits, decision questions.

A *session* holds one long context (order records and store policies) with one named field,
the status of a target order, placed at a chosen depth. Then it receives a stream of edits to
that field; after each edit it asks the same decision question. Each edit becomes one request
per policy:

- ``in-place``: the context re-sent with the field changed (what a user does today); the
  prefix cache can only reuse the tokens before the field.
- ``erratum``: the original context byte-identical, followed by the corrections and the
  question; the prefix cache can reuse the whole old context. How the corrections are written
  is the session's ``errata`` form (:data:`ERRATA_FORMS`): ``append``, one correction per edit
  so far, then the question (each request extends the previous one's errata); ``latest``, one
  correction from the context's value to the current one, then the question (the errata block is
  rewritten: it costs the same few tokens, and a model never has to pick the latest of several);
  ``follow-up``, the previous request whole (the question included) followed by this edit's
  correction and a short request to answer again, as in a conversation where the correction
  arrives after the question: the prefix cache then reuses the question too;
  ``follow-up-latest``, the first request (context and question) followed by one correction from
  the context's value to the current one and the re-ask: the question is reused, and every
  request has the shape of the first edit's.
- ``cold``: the in-place prompts with the prefix cache defeated (a unique ``cache_salt`` per
  request): the no-cache baseline.

Everything here is pure and deterministic given the seed; token counts come from a callable
(the model's tokenizer, or the server's ``/tokenize``), so the generator needs no model.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvnotes.core.errors import InvalidArgumentError, UnknownNameError
from kvnotes.ops.edit import erratum_text

POLICIES: tuple[str, ...] = ("in-place", "erratum", "cold")

# the statuses under which the decision policy approves a refund, and those it declines
REFUND_STATUSES: tuple[str, ...] = ("delivered", "returned", "delivered late",
                                    "returned unopened", "delivered to a locker")
DECLINE_STATUSES: tuple[str, ...] = ("pending", "shipped", "cancelled", "lost", "on hold",
                                     "in transit", "awaiting payment")
STATUSES: tuple[str, ...] = REFUND_STATUSES + DECLINE_STATUSES
MAX_EDITS = len(STATUSES) - 1  # every edit brings a value the session has not seen yet
ANSWERS: tuple[str, ...] = ("yes", "no")
# What each session asks after an edit. "decision": the refund decision the policy implies (a
# reasoning step over the field); "status": the field's current value itself (retrieval: whether
# the model reads the edit at all, which a small model answering "yes" to everything hides).
QUESTIONS: tuple[str, ...] = ("decision", "status")
# How the erratum policy writes its corrections: form -> what the report says of it. Two choices
# make a form: one correction per edit so far ("is B, not A", then "is C, not B"; small models
# then tend to repeat the first) or one from the context's value to the current one ("is C, not
# A"), and before the question or after the first request with a short re-ask (the question is
# then computed once, at the warm-up).
ERRATA_FORMS: dict[str, str] = {
    "append": "one correction per edit so far, before the question (appended)",
    "latest": "one correction, from the context's value to the current one, before the "
              "question (rewritten per edit)",
    "follow-up": "after the question, one correction per edit so far, each followed by a "
                 "request to answer again (each request extends the previous one)",
    "follow-up-latest": "after the question, one correction from the context's value to the "
                        "current one and a request to answer again",
}
ONE_CORRECTION = frozenset({"latest", "follow-up-latest"})
AFTER_QUESTION = frozenset({"follow-up", "follow-up-latest"})
# the default: the fastest form and the only one SmolLM2 read right after every edit
# (docs/results.md, "Where the corrections go")
DEFAULT_ERRATA = "follow-up-latest"
REASK = "Answer again."
# longest first: parse_answer breaks ties at one position by order ("delivered late" over
# "delivered")
STATUS_ANSWERS: tuple[str, ...] = tuple(sorted(STATUSES, key=len, reverse=True))

_FIRST = ("Dana", "Luis", "Mei", "Omar", "Priya", "Tomas", "Aiko", "Ruth", "Jonas", "Fatima",
          "Elena", "Kwame", "Ines", "Viktor", "Sara", "Noah")
_LAST = ("Ortiz", "Chen", "Haddad", "Nowak", "Rao", "Berg", "Sato", "Mensah", "Costa", "Keller",
         "Silva", "Dubois", "Okafor", "Larsen", "Moreau", "Kim")
_ITEMS = ("ceramic kettle", "wool blanket", "desk lamp", "trail backpack", "espresso grinder",
          "cast-iron pan", "bike helmet", "noise-cancelling headphones", "yoga mat",
          "garden hose", "standing desk", "rain jacket", "board game", "water filter")
_CITIES = ("Lisbon", "Osaka", "Nairobi", "Denver", "Krakow", "Lyon", "Austin", "Porto", "Leeds")
_POLICIES = (
    "Shipping policy: orders placed before 2 pm ship the same business day; heavy items ship "
    "by freight and may take up to ten business days.",
    "Exchange policy: an item may be exchanged once for a different size or colour within 45 "
    "days, provided the original packaging is kept.",
    "Price-match policy: if the same item is sold cheaper by a listed competitor within 14 "
    "days of purchase, the difference is credited as store credit.",
    "Warranty policy: electrical items carry a two-year warranty; claims need the order number "
    "and a short description of the fault.",
    "Loyalty policy: members earn one point per dollar spent; points expire after 18 months "
    "without a purchase.",
    "Privacy policy: customer addresses are kept only as long as needed to fulfil the order "
    "and handle returns.",
    "Damage policy: items that arrive damaged are replaced free of charge when reported with "
    "photos within 7 days of arrival.",
)
DECISION_POLICY = (
    "Refund policy (binding): a refund may be approved only when the order's status says it "
    "was delivered or returned. Orders that are pending, shipped, in transit, on hold, awaiting "
    "payment, cancelled or lost are never refunded; their requests are declined."
)


@dataclass(frozen=True)
class Turn:
    """One edit in a session's stream: the field goes from ``old`` to ``new``."""

    index: int
    old: str
    new: str

    @property
    def expected(self) -> str:
        """The decision the refund policy implies for the new value."""
        return "yes" if self.new in REFUND_STATUSES else "no"


@dataclass(frozen=True)
class Session:
    """One long context with a field at a given depth, and the stream of edits it receives.

    ``before`` + field value + ``after`` is the context; the field's value is the target order's
    status. ``field_char`` is the character offset of the value inside the context.
    """

    session_id: str
    before: str
    after: str
    initial: str
    turns: tuple[Turn, ...]
    order_id: str
    context_tokens: int = 0  # as measured by the count function at build time
    field_token_depth: float = 0.0  # tokens before the field / context tokens
    meta: dict[str, Any] = field(default_factory=dict)
    question_kind: str = "decision"  # one of QUESTIONS
    errata: str = DEFAULT_ERRATA  # one of ERRATA_FORMS

    def __post_init__(self) -> None:
        if self.question_kind not in QUESTIONS:
            raise UnknownNameError("question", self.question_kind, QUESTIONS)
        if self.errata not in ERRATA_FORMS:
            raise UnknownNameError("errata form", self.errata, ERRATA_FORMS)

    @property
    def field_label(self) -> str:
        return f"status of order #{self.order_id}"

    @property
    def question(self) -> str:
        if self.question_kind == "status":
            return (f"Question: what is the current status of order #{self.order_id}? Answer "
                    "with the status only.")
        return (f"Question: a customer asks for a refund of order #{self.order_id}. Following "
                "the refund policy and the order's current status, should the refund be "
                "approved? Answer with one word, yes or no.")

    @property
    def answers(self) -> tuple[str, ...]:
        """The choices a response is parsed into."""
        return STATUS_ANSWERS if self.question_kind == "status" else ANSWERS

    def expected(self, turn: int) -> str:
        """The right answer after edit ``turn``: the refund policy's decision for the new
        value, or the new value itself."""
        t = self.turns[turn]
        return t.new if self.question_kind == "status" else t.expected

    @property
    def stale(self) -> str:
        """The answer the session's original value gives (the value the cached context, and the
        erratum's unchanged prefix, still hold): a model that misses the edits answers this."""
        if self.question_kind == "status":
            return self.initial
        return "yes" if self.initial in REFUND_STATUSES else "no"

    def context(self, value: str | None = None) -> str:
        """The context with the field at ``value`` (the initial value when None)."""
        return f"{self.before}{self.initial if value is None else value}{self.after}"

    def warmup_prompt(self) -> str:
        """The session's first request (initial value): what the server has seen before edits."""
        return f"{self.context()}\n\n{self.question}"

    def errata_text(self, turn: int) -> str:
        """The corrections an erratum request carries after edit ``turn`` (plain text: the
        serving harness puts them inside the same user message as the context)."""
        if self.errata in ONE_CORRECTION:  # the context's value -> the current one
            fixes = [erratum_text(self.field_label, self.initial, self.turns[turn].new)]
        else:  # one per edit so far
            fixes = [erratum_text(self.field_label, u.old, u.new) for u in self.turns[:turn + 1]]
        if self.errata in AFTER_QUESTION:  # each after a request: answer again
            return "\n\n".join(f"{fix} {REASK}" for fix in fixes)
        return "\n".join(fixes)

    def prompt(self, policy: str, turn: int) -> str:
        """The user message for edit ``turn`` (0-based) under ``policy``."""
        if policy not in POLICIES:
            raise UnknownNameError("policy", policy, POLICIES)
        t = self.turns[turn]
        if policy == "erratum":
            if self.errata in AFTER_QUESTION:
                return f"{self.warmup_prompt()}\n\n{self.errata_text(turn)}"
            return f"{self.context()}\n\n{self.errata_text(turn)}\n\n{self.question}"
        return f"{self.context(t.new)}\n\n{self.question}"


def _record(rng: random.Random, order_id: str) -> tuple[str, str]:
    """An order record split around its status value: (text before it, text after it)."""
    name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    qty = rng.randint(1, 4)
    price = rng.randint(900, 25000) / 100
    day = f"2026-{rng.randint(1, 10):02d}-{rng.randint(1, 28):02d}"
    head = (f"Order #{order_id}: customer {name} ({rng.choice(_CITIES)}); item: "
            f"{rng.choice(_ITEMS)} x{qty}; total: ${qty * price:.2f}; placed {day}; status: ")
    tail = f"; payment: {rng.choice(('card', 'invoice', 'gift card', 'bank transfer'))}."
    return head, tail


def _filler(rng: random.Random, used: set[str]) -> str:
    if rng.random() < 0.2:
        return rng.choice(_POLICIES)
    oid = _new_id(rng, used)
    head, tail = _record(rng, oid)
    return f"{head}{rng.choice(STATUSES)}{tail}"


def _new_id(rng: random.Random, used: set[str]) -> str:
    while True:
        oid = str(rng.randint(10000, 99999))
        if oid not in used:
            used.add(oid)
            return oid


def edit_stream(rng: random.Random, initial: str, n: int) -> tuple[Turn, ...]:
    """``n`` edits, each to a value the session has not held before (so an in-place prompt is
    never one the server has already seen), flipping the implied decision whenever an unseen
    value of the other kind is left (so a model that ignores the edit is visible)."""
    if n > MAX_EDITS:
        raise InvalidArgumentError(f"at most {MAX_EDITS} edits per session (distinct values), got {n}")
    turns, current, seen = [], initial, {initial}
    for i in range(n):
        want_yes = current not in REFUND_STATUSES
        unseen = [s for s in STATUSES if s not in seen]
        flip = [s for s in unseen if (s in REFUND_STATUSES) == want_yes]
        new = rng.choice(flip or unseen)
        turns.append(Turn(i, current, new))
        seen.add(new)
        current = new
    return tuple(turns)


def make_session(session_id: str, *, context_tokens: int, depth: float, edits: int,
                 count_tokens: Callable[[str], int], seed: int = 0,
                 question: str = "decision", errata: str = DEFAULT_ERRATA) -> Session:
    """One session: at most about ``context_tokens`` tokens, the field at ``depth`` (0..1).

    The context is a header naming the session (so sessions share no prefix beyond the chat
    template), order records and policies, the binding refund policy, and the target order,
    whose status is the field. Blocks are added until the token budget is met; the target
    record goes where the tokens before it reach ``depth`` of the budget.
    """
    if context_tokens < 64:
        raise InvalidArgumentError(f"context_tokens must be at least 64, got {context_tokens}")
    if not 0.0 <= depth <= 1.0:
        raise InvalidArgumentError(f"depth must lie in [0, 1], got {depth}")
    if not 1 <= edits <= MAX_EDITS:
        raise InvalidArgumentError(f"a session takes 1 to {MAX_EDITS} edits, got {edits}")
    rng = random.Random(f"{seed}:{session_id}")
    used: set[str] = set()
    header = (f"Case file {session_id}. Customer-service records of an online store, followed "
              "by its policies.\n\n")
    order_id = _new_id(rng, used)
    head, tail = _record(rng, order_id)
    initial = rng.choice(sorted(STATUSES))
    sep = "\n\n"
    target_before = max(0, int(depth * context_tokens))

    n_before = count_tokens(header)
    head_tokens = count_tokens(head)
    n_policy = count_tokens(DECISION_POLICY + sep)
    before_blocks: list[str] = []
    room = target_before - n_before - head_tokens
    if n_policy - room <= room:
        before_blocks.append(DECISION_POLICY)  # the binding policy first, if the depth allows
        n_before += n_policy
    while n_before + head_tokens < target_before:
        block = _filler(rng, used)
        n_block = count_tokens(block + sep)
        gap = target_before - n_before - head_tokens
        if n_block - gap > gap:
            break  # adding the block would land further from the target depth
        before_blocks.append(block)
        n_before += n_block
    # the binding policy goes first when the depth leaves room for it, else last
    closing = [] if before_blocks[:1] == [DECISION_POLICY] else [DECISION_POLICY]
    n_field = count_tokens(f"{head}{initial}{tail}{sep}")
    n_after = sum(count_tokens(b + sep) for b in closing)
    after_blocks: list[str] = []
    misses = 0
    while misses < 8:  # fill up to the budget without exceeding it
        block = _filler(rng, used)
        n_block = count_tokens(block + sep)
        if n_before + n_field + n_after + n_block > context_tokens:
            misses += 1
            continue
        after_blocks.append(block)
        n_after += n_block
    before = header + "".join(b + sep for b in before_blocks) + head
    while True:  # block-wise counts are approximate (merges at joins): trim to the budget
        after = tail + "".join(sep + b for b in after_blocks + closing)
        total = count_tokens(before + initial + after)
        if total <= context_tokens or not after_blocks:
            break
        after_blocks.pop()
    depth_measured = count_tokens(before) / max(total, 1)
    return Session(session_id=session_id, before=before, after=after, initial=initial,
                   turns=edit_stream(rng, initial, edits), order_id=order_id,
                   context_tokens=total, field_token_depth=depth_measured,
                   question_kind=question, errata=errata)


def make_sessions(n: int, *, context_tokens: int, depth: float, edits: int,
                  count_tokens: Callable[[str], int], tag: str = "run",
                  seed: int = 0, question: str = "decision",
                  errata: str = DEFAULT_ERRATA) -> list[Session]:
    """``n`` independent sessions whose ids start with ``tag`` (one tag per benchmark run, so
    that no run finds another run's prompts in the prefix cache)."""
    return [make_session(f"{tag}-s{i}", context_tokens=context_tokens, depth=depth, edits=edits,
                         count_tokens=count_tokens, seed=seed, question=question,
                         errata=errata)
            for i in range(n)]

