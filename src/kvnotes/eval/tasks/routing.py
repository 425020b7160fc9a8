"""Ticket routing: a rule stated first maps a ticket's category to one of three named teams.

Built for models that ignore the policy families' field (on Qwen2.5-Coder every eligibility,
membership and scheduling case keeps its decision when the field changes): here the rule comes
first, the ticket's ``category`` field sits in the middle, and the lines after it talk about
the ticket and its category, so the tokens after the field have the field in view when they
write their notes. The question asks for the team; the three team names start with different
tokens, so the decision is a first-token choice like every other family's.

Each case is generated from one integer seed (categories, teams and the mapping are drawn
from it), so any number of cases exists and settings can be chosen on some seeds and reported
on others: **development seeds** ``DEV_SEEDS`` (0-15) were the only ones looked at while the
template was written; **held-out seeds** ``HELDOUT_SEEDS`` (1000-1047) were not, and they are
the ``routing`` family that :func:`~kvnotes.eval.tasks.load_suite` returns.

Category names are chosen so that each is one token after ``": "`` in the bundled Qwen, SmolLM2
and Gemma tokenizers, so old and new values line up token for token for tracing.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvnotes.core.document import Document, Field
from kvnotes.eval.tasks.base import EditCase, register_seeded_family
from kvnotes.eval.tasks.families import _name

DEV_SEEDS: tuple[int, ...] = tuple(range(16))
HELDOUT_SEEDS: tuple[int, ...] = tuple(range(1000, 1048))

# category -> the team it goes to (the mapping a reader expects, so the rule is easy to apply);
# the team names start with different tokens
_TEAM_OF = {"payment": "Finance", "login": "Security", "delivery": "Logistics",
            "hardware": "Hardware", "contract": "Legal", "network": "Network"}


def _routing(seed: int) -> EditCase:
    rng = random.Random(f"routing-{seed}")
    categories = rng.sample(sorted(_TEAM_OF), 3)
    teams = [_TEAM_OF[c] for c in categories]
    team_of = _TEAM_OF
    old, new = rng.sample(categories, 2)
    rule = "; ".join(f"a ticket whose category is {c} goes to the {team_of[c]} team"
                     for c in categories)
    doc = Document([
        f"SUPPORT DESK ROUTING\nRouting rule: {rule}.\n\n"
        f"TICKET #{rng.randint(100000, 999999)}\nCustomer: {_name(rng)}\nCategory: ",
        Field("category", old),
        "\nPriority: low\nTriage note: the agent read the message, confirmed that the category "
        "recorded above is the right one for this ticket, and applied the routing rule to it.\n",
    ])
    return EditCase("routing", f"routing-s{seed}", doc, "category", old, new,
                    f"Which team handles this ticket? Answer {', '.join(teams[:2])} or "
                    f"{teams[2]}.", tuple(teams), team_of[old], team_of[new],
                    tags=(f"seed:{seed}",))


@register_seeded_family("routing", dev_seeds=DEV_SEEDS, heldout_seeds=HELDOUT_SEEDS)
def routing_cases(seeds: Sequence[int]) -> list[EditCase]:
    """One case per seed."""
    return [_routing(s) for s in seeds]
