"""The edit case type and the family registry of the task suite.

Each :class:`EditCase` is a realistic context (a record, a policy, a few hundred tokens) with
one named field early on, an old and a new value, a question and the answer choices the
decision parses to. The families live in their own modules and register in :data:`FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvnotes.core.document import Document
from kvnotes.core.errors import InvalidArgumentError, UnknownNameError


@dataclass(frozen=True)
class EditCase:
    """One field edit with a decision question.

    ``document`` holds the field at its *old* value. ``question`` is appended after the
    document (for chat models the evaluator wraps context and question in the chat template).
    ``answers`` are the decision choices; :func:`kvnotes.ops.decisions.parse_answer` maps model
    text to one of them.
    """

    family: str
    case_id: str
    document: Document
    field: str
    old_value: str
    new_value: str
    question: str
    answers: tuple[str, ...]
    expected_old: str | None = None  # the decision the task author intends for the old value
    expected_new: str | None = None
    tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.document.value(self.field) != self.old_value:
            raise InvalidArgumentError(f"{self.case_id}: document holds {self.document.value(self.field)!r}"
                             f" for {self.field!r}, not the old value {self.old_value!r}")

    @property
    def new_document(self) -> Document:
        return self.document.with_value(self.field, self.new_value)


CaseFamily = Callable[[], list[EditCase]]

# family name -> zero-argument function returning that family's cases
FAMILIES: dict[str, CaseFamily] = {}


def register_family(name: str) -> Callable[[CaseFamily], CaseFamily]:
    def wrap(fn: CaseFamily) -> CaseFamily:
        FAMILIES[name] = fn
        return fn
    return wrap


SPLITS = ("heldout", "dev")


@dataclass(frozen=True, slots=True)
class SeededFamily:
    """A family generated from integer seeds, with the seeds its template was written on
    (``dev_seeds``) kept apart from the seeds results are reported on (``heldout_seeds``)."""

    name: str
    make: Callable[[Sequence[int]], list[EditCase]]
    dev_seeds: tuple[int, ...]
    heldout_seeds: tuple[int, ...]

    def cases(self, split: str = "heldout") -> list[EditCase]:
        if split not in SPLITS:
            raise UnknownNameError("seed split", split, SPLITS)
        return self.make(self.heldout_seeds if split == "heldout" else self.dev_seeds)


# family name -> its seeds and generator (also registered in FAMILIES with its held-out seeds)
SEEDED_FAMILIES: dict[str, SeededFamily] = {}

SeededMaker = Callable[[Sequence[int]], list[EditCase]]


def register_seeded_family(name: str, *, dev_seeds: Sequence[int],
                           heldout_seeds: Sequence[int]) -> Callable[[SeededMaker], SeededMaker]:
    """Register a seeded family; :data:`FAMILIES` gets its held-out cases."""
    if set(dev_seeds) & set(heldout_seeds):
        raise InvalidArgumentError(f"{name}: development and held-out seeds overlap")

    def wrap(fn: SeededMaker) -> SeededMaker:
        family = SeededFamily(name, fn, tuple(dev_seeds), tuple(heldout_seeds))
        SEEDED_FAMILIES[name] = family
        FAMILIES[name] = family.cases
        return fn
    return wrap
