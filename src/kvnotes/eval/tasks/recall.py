"""Capital-city recall: the answer is a fact the model recalls about the field's value.

Field = ``country`` in a short travel record; the question asks for that country's capital. Unlike
the policy families, no rule downstream turns the field into a decision: the model has to look
the country up when it reads the question. On Gemma-3-270M (docs/design.md, "Recall lives in
the field") here the field's own KV carries the answer, the opposite of the paper's policy finding;
this family lets :mod:`kvnotes.ops.trace` show that outcome.

Countries are chosen so that each is one token (tokenized alone) in both bundled tokenizers,
so old and new values line up token for token.
"""

from __future__ import annotations

import random

from kvnotes.core.document import Document, Field
from kvnotes.eval.tasks.base import EditCase, register_family

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Japan": "Tokyo", "China": "Beijing", "Russia": "Moscow", "Egypt": "Cairo",
    "Canada": "Ottawa", "Iran": "Tehran", "Hungary": "Budapest", "Australia": "Canberra",
}

_NAMES = ["Maria Alvarez", "James Okafor", "Aiko Tanaka", "Daniel Schmidt", "Priya Sharma",
          "Oliver Bennett", "Sofia Rossi", "Noah Walsh"]
_FILLER = [
    "The flight landed two hours late, so the first evening was spent at the hotel.",
    "Luggage arrived on the second day after a call to the airline.",
    "The group visited a museum, a market and a park during the first week.",
    "Meals were booked in advance for every night of the stay.",
    "A local guide met the travelers each morning in the hotel lobby.",
    "The weather was mild and only one excursion had to be moved.",
    "Receipts for all expenses were collected and scanned for the report.",
    "The return trip was confirmed three days before departure.",
]


def _recall(rng: random.Random, old: str, new: str, case_id: str) -> EditCase:
    lines = rng.sample(_FILLER, 5)
    doc = Document([
        f"TRAVEL RECORD {rng.randint(1000, 9999)}\nTraveler: {rng.choice(_NAMES)}\n"
        "Country visited: ", Field("country", old),
        f"\nDuration: {rng.randint(4, 21)} days\n" + "\n".join(lines) + "\n",
    ])
    return EditCase("capital_recall", case_id, doc, "country", old, new,
                    "What is the capital city of the country visited in this record?",
                    (CAPITALS[old], CAPITALS[new]), CAPITALS[old], CAPITALS[new],
                    tags=("recall",))


@register_family("capital_recall")
def capital_recall_cases() -> list[EditCase]:
    """24 cases: each country paired with the ones 5 and 7 places further in the list."""
    countries = list(CAPITALS)
    k = len(countries)
    out: list[EditCase] = []
    for step in (5, 7):
        for i, old in enumerate(countries):
            new = countries[(i + step) % k]
            out.append(_recall(random.Random(f"recall-{i}-{step}"), old, new,
                               f"capital_recall-{len(out):03d}"))
    return out
