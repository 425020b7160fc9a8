"""Scripted customer-service episodes: a starting record, then turns of requests with state
changes (events) between them. Deterministic: episode ``i`` is the same on every run, and an
episode with fewer turns is a prefix of the same episode with more.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvnotes.apps.agent.state import Event, State
from kvnotes.core.errors import KvnotesError, UnknownNameError


@dataclass(frozen=True, slots=True)
class Request:
    """A customer request: the text, the skills it needs, the decision options and the tool
    that acting on it takes (called when the decision is one of ``acts``)."""

    text: str
    skills: tuple[str, ...]
    options: tuple[str, ...]
    kind: str = "custom"
    tool: str | None = None
    acts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.options) < 2:
            raise KvnotesError(f"a request needs at least two options, got {self.options}")
        if any(a not in self.options for a in self.acts):
            raise KvnotesError(f"acts {self.acts} must be among the options {self.options}")


@dataclass(frozen=True, slots=True)
class Turn:
    """One turn: the events that happened since the previous turn, then the request."""

    request: Request
    events: tuple[Event, ...] = ()


@dataclass(frozen=True, slots=True)
class Episode:
    episode_id: str
    state: State
    turns: tuple[Turn, ...] = field(default_factory=tuple)


REFUND_OPTIONS = ("full refund", "travel credit", "nothing")

# kind -> (text template, skills, options, tool, options that act)
REQUESTS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...], str | None, tuple[str, ...]]] = {
    "cancel": ("I need to cancel reservation {rid} because my plans changed. What will I get back?",
               ("cancellation", "refunds"), REFUND_OPTIONS, "cancel_reservation",
               ("full refund", "travel credit")),
    "cancel_ill": ("I have to cancel reservation {rid} because I am sick. What will I get back?",
                   ("cancellation", "insurance"), REFUND_OPTIONS, "cancel_reservation",
                   ("full refund", "travel credit")),
    "refund_card": ("Can you put the money for reservation {rid} back on my card instead?",
                    ("refunds", "cancellation"), ("approve", "deny"), "issue_refund", ("approve",)),
    "delay_refund": ("With this flight situation I would rather not travel at all. Can I get my "
                     "money back for {rid}?", ("refunds", "compensation"), REFUND_OPTIONS,
                     "cancel_reservation", ("full refund", "travel credit")),
    "add_bag": ("I want to add one more checked bag to reservation {rid}. Is it free or is there "
                "a fee?", ("baggage",), ("free", "fee"), "update_baggage", ("free", "fee")),
    "compensation": ("This flight has been a terrible experience. Am I owed any compensation?",
                     ("compensation",), ("voucher", "none"), "issue_voucher", ("voucher",)),
    "upgrade": ("Can I upgrade reservation {rid} to business class? I want to use my membership.",
                ("membership",), ("approve", "deny"), "upgrade_cabin", ("approve",)),
    "same_day": ("Can I switch to an earlier flight on the same day? Is the change free?",
                 ("membership",), ("free", "fee"), None, ()),
    "email": ("Please change the email on my account to {new_email}.",
              ("account_changes",), ("update", "transfer"), "update_account", ("update",)),
    "name_change": ("Please change the passenger name on {rid} to my sister, Laura Brenner.",
                    ("account_changes", "escalation"), ("update", "transfer"),
                    "transfer_to_human", ("transfer",)),
    "human": ("I am not happy with this. Can I talk to a human agent?",
              ("escalation",), ("transfer", "resolve"), "transfer_to_human", ("transfer",)),
    "insurance_work": ("Does my travel insurance cover cancelling because of a work conflict?",
                       ("insurance",), ("yes", "no"), None, ()),
}

NAMES = ["Ana Ruiz", "Tom Becker", "Mei Lin", "Omar Haddad", "Sofia Rossi", "Jonas Berg",
         "Priya Nair", "Lucas Martin", "Hana Sato", "Daniel Okafor"]
BOOKED = ["2 hours ago", "10 hours ago", "2 days ago", "5 days ago", "3 weeks ago"]
DEPARTURE = ["in 3 days", "in 9 days", "in 30 days"]
PAYMENT = ["credit card", "gift card", "travel certificate"]

NEXT_TIER = {"regular": "silver", "silver": "gold"}
NEXT_CABIN = {"basic economy": "economy", "economy": "business"}
NEXT_STATUS = {"scheduled": "delayed by 6 hours", "delayed by 6 hours": "cancelled by the airline"}


def request(kind: str, state: State, rng: random.Random | None = None) -> Request:
    """The request of ``kind`` filled in for ``state``; unknown kinds list the valid ones."""
    if kind not in REQUESTS:
        raise UnknownNameError("request kind", kind, sorted(REQUESTS))
    template, skills, options, tool, acts = REQUESTS[kind]
    rng = rng or random.Random(0)
    user = state["customer_name"].split()[0].lower()
    text = template.format(rid=state["reservation_id"],
                           new_email=f"{user}.{rng.randint(10, 99)}@mailbox.org")
    return Request(text=text, skills=skills, options=options, kind=kind, tool=tool, acts=acts)


def _initial_state(rng: random.Random) -> State:
    name = rng.choice(NAMES)
    rid = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ23456789") for _ in range(6))
    return State({
        "customer_name": name,
        "reservation_id": rid,
        "email": f"{name.split()[0].lower()}@example.com",
        "membership": rng.choice(["regular", "regular", "silver"]),
        "cabin": rng.choice(["basic economy", "economy", "economy"]),
        "booked": rng.choice(BOOKED),
        "departure": rng.choice(DEPARTURE),
        "flight_status": "scheduled",
        "insurance": "none",
        "checked_bags": str(rng.randint(0, 2)),
        "passengers": str(rng.randint(1, 3)),
        "payment_method": rng.choice(PAYMENT),
    })


def _possible_events(state: State, rng: random.Random) -> list[Event]:
    events = []
    if state["insurance"] == "none":
        events.append(Event("insurance", "purchased", "the customer bought travel insurance"))
    if state["membership"] in NEXT_TIER:
        events.append(Event("membership", NEXT_TIER[state["membership"]],
                            "the membership tier was upgraded"))
    if state["cabin"] in NEXT_CABIN:
        events.append(Event("cabin", NEXT_CABIN[state["cabin"]], "the cabin was upgraded"))
    if state["flight_status"] in NEXT_STATUS:
        events.append(Event("flight_status", NEXT_STATUS[state["flight_status"]],
                            "the airline changed the flight status"))
    bags = int(state["checked_bags"])
    if bags < 4:
        events.append(Event("checked_bags", str(bags + 1), "a checked bag was added"))
    events.append(Event("booked", rng.choice(["2 hours ago", "4 days ago"]),
                        "the reservation was rebooked"))
    return events


def scripted_episode(index: int, turns: int = 5) -> Episode:
    """Episode ``index`` with ``turns`` turns (deterministic; fewer turns = a prefix)."""
    if turns < 1:
        raise KvnotesError(f"an episode needs at least one turn, got {turns}")
    rng = random.Random(1000 + index)
    state = _initial_state(rng)
    start = state
    kinds = list(REQUESTS)
    out: list[Turn] = []
    for t in range(turns):
        events: list[Event] = []
        if t > 0:
            count = 1 if rng.random() < 0.65 else (2 if rng.random() < 0.6 else 0)
            for _ in range(count):
                options = [e for e in _possible_events(state, rng)
                           if e.field not in {x.field for x in events}]
                if options:
                    event = rng.choice(options)
                    events.append(event)
                    state = state.apply([event])
        out.append(Turn(request(rng.choice(kinds), state, rng), tuple(events)))
    return Episode(f"ep{index:03d}", start, tuple(out))


def scripted_episodes(n: int = 40, turns: int = 5, *, first: int = 0) -> list[Episode]:
    """The benchmark's episodes: ``n`` scripted episodes of ``turns`` turns each, from episode
    ``first`` on (the benchmark's are 0..n-1; a later range is a held-out set for tuning)."""
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise KvnotesError(f"first must be an episode index >= 0, got {first!r}")
    return [scripted_episode(i, turns) for i in range(first, first + n)]


# keyword -> request kind, first match wins (for requests typed by a person)
ROUTES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("sick", "ill", "illness"), "cancel_ill"),
    (("cancel",), "cancel"),
    (("refund", "money back", "card"), "refund_card"),
    (("bag", "luggage", "suitcase"), "add_bag"),
    (("compensation", "voucher", "owed"), "compensation"),
    (("upgrade", "business"), "upgrade"),
    (("earlier", "same day", "same-day", "switch"), "same_day"),
    (("email", "e-mail"), "email"),
    (("name",), "name_change"),
    (("insurance", "cover"), "insurance_work"),
    (("human", "person", "agent", "manager"), "human"),
)


def route(text: str) -> Request:
    """A typed request, given the skills, options and tool of the first matching request kind
    (an escalation question when nothing matches)."""
    lowered = text.lower()
    kind = next((k for words, k in ROUTES if any(w in lowered for w in words)), "human")
    _, skills, options, tool, acts = REQUESTS[kind]
    return Request(text=text.strip(), skills=skills, options=options, kind=kind, tool=tool,
                   acts=acts)
