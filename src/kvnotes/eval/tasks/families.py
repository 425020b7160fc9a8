"""The field -> decision task families: records and policies with one editable field early on.

Seven families, 24 cases each (168 in all). Every context is a realistic record of a few hundred
tokens: a header, the field within the first lines, a dozen record lines that do not depend on
the field, then the policy that turns the field into a decision. Contexts are generated from a
fixed seed per case, so the suite is the same on every machine.

Families: ``refund`` (order status -> refundable), ``eligibility`` (applicant age/residency ->
approved or denied), ``membership`` (tier -> free express shipping), ``scheduling`` (day ->
attendance conflict), ``threshold`` (a numeric reading -> alert or normal), ``access`` (role ->
allow or deny) and ``lookup`` (the answer is the field's own value).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from kvnotes.core.document import Document, Field
from kvnotes.eval.tasks.base import EditCase, register_family

CASES_PER_FAMILY = 24
# the families defined here (other modules may register more, e.g. tasks/recall.py)
EDIT_FAMILIES = ("refund", "eligibility", "membership", "scheduling", "threshold", "access",
                 "lookup")

_FIRST = ["Maria", "James", "Aiko", "Daniel", "Fatima", "Lukas", "Priya", "Oliver", "Chen",
          "Sofia", "Mateo", "Amara", "Noah", "Elena", "Ravi", "Hannah", "Tomasz", "Grace"]
_LAST = ["Alvarez", "Okafor", "Tanaka", "Schmidt", "Haddad", "Novak", "Sharma", "Bennett",
         "Li", "Rossi", "Fernandez", "Mensah", "Walsh", "Petrova", "Iyer", "Murphy", "Kowalski"]
_CITIES = ["Portland", "Austin", "Denver", "Boston", "Chicago", "Atlanta", "Seattle", "Phoenix",
           "Dallas", "Miami"]
_STREETS = ["Maple Avenue", "Harbor Road", "Cedar Lane", "Station Street", "Hillcrest Drive",
            "Lake View Court", "Mill Road", "Orchard Way"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December"]
_REMARKS = [
    "Customer prefers contact by email rather than phone.",
    "Previous correspondence was handled by the regional office.",
    "No outstanding complaints are recorded for this account.",
    "The account was migrated from the legacy system last year.",
    "A courtesy call was logged after the last interaction.",
    "Paperwork was scanned and attached to the file.",
    "The contact details were verified during the last review.",
    "Marketing messages are disabled for this account.",
    "The file was reviewed by a second agent for completeness.",
    "All identity documents on file are current.",
]


def _name(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"


def _date(rng: random.Random, year: int = 2025) -> str:
    return f"{rng.choice(_MONTHS)} {rng.randint(1, 28)}, {year}"


def _record_lines(rng: random.Random, n: int = 9) -> str:
    """Field-independent record lines that make the context realistic and long."""
    pool = [
        f"Contact: {_name(rng)}",
        f"Email: {rng.choice(_FIRST).lower()}.{rng.choice(_LAST).lower()}@example.com",
        f"Phone: +1 555 {rng.randint(100, 999)} {rng.randint(1000, 9999)}",
        f"Address: {rng.randint(10, 990)} {rng.choice(_STREETS)}, {rng.choice(_CITIES)}",
        f"Created: {_date(rng, 2024)}",
        f"Last updated: {_date(rng)}",
        f"Case handler: {_name(rng)}",
        f"Reference code: {rng.choice('ABCDEFGH')}{rng.randint(10000, 99999)}",
        f"Preferred language: {rng.choice(['English', 'Spanish', 'French', 'German'])}",
        f"Remarks: {rng.choice(_REMARKS)}",
        f"Internal note: {rng.choice(_REMARKS)}",
    ]
    rng.shuffle(pool)
    return "\n".join(pool[:n]) + "\n"


# one case from (seeded rng, old value, new value, case id)
CaseMaker = Callable[[random.Random, str, str, str], EditCase]


def _cases(family: str, make: CaseMaker, pairs: Sequence[tuple[str, str]],
           per_pair: int) -> list[EditCase]:
    out: list[EditCase] = []
    for i, (old, new) in enumerate(pairs):
        for j in range(per_pair):
            rng = random.Random(f"{family}-{i}-{j}")
            out.append(make(rng, old, new, f"{family}-{len(out):03d}"))
    return out[:CASES_PER_FAMILY]


# ---- refund: order status -> refundable -----------------------------------------------------
_REFUNDABLE = {"pending": True, "processing": True, "shipped": False, "delivered": False}


def _refund(rng: random.Random, old: str, new: str, case_id: str) -> EditCase:
    items = rng.sample(["wireless headphones", "a desk lamp", "running shoes", "a coffee grinder",
                        "a backpack", "a phone case", "a yoga mat", "a cookbook"], 2)
    total = rng.randint(25, 400)
    doc = Document([
        f"ORDER RECORD #{rng.randint(100000, 999999)}\nOrder status: ", Field("status", old),
        f"\nCustomer: {_name(rng)}\nItems: {items[0]} and {items[1]}\n"
        f"Order total: ${total}.{rng.randint(0, 99):02d}\nPayment method: "
        f"{rng.choice(['credit card', 'PayPal', 'gift card', 'bank transfer'])}\n",
        _record_lines(rng),
        "\nREFUND POLICY\nA refund can be issued only while the order status is pending or "
        "processing, because nothing has left the warehouse yet. Once the order status is shipped "
        "or delivered, a refund is not possible: the customer has to open a return request "
        "instead, and the return must be received before any money is paid back. Agents must "
        "base their decision on the order status shown in this record.\n",
    ])
    yes = {True: "yes", False: "no"}
    return EditCase("refund", case_id, doc, "status", old, new,
                    "Can this order be refunded right now? Answer yes or no.", ("yes", "no"),
                    yes[_REFUNDABLE[old]], yes[_REFUNDABLE[new]])


@register_family("refund")
def refund_cases() -> list[EditCase]:
    pairs = [("pending", "delivered"), ("delivered", "pending"), ("processing", "shipped"),
             ("shipped", "processing"), ("pending", "shipped"), ("delivered", "processing")]
    return _cases("refund", _refund, pairs, 4)


# ---- eligibility: applicant age / residency -> approved or denied ---------------------------
def _eligibility(rng: random.Random, old: str, new: str, case_id: str) -> EditCase:
    kind = "age" if old.isdigit() else "residency"
    program = rng.choice(["the Youth Travel Grant", "the Community Housing Subsidy",
                          "the Small Business Starter Loan", "the Adult Education Bursary"])
    head = (f"APPLICATION FILE {rng.randint(1000, 9999)}\nProgram: {program}\n"
            f"Applicant: {_name(rng)}\n")
    parts: list[str | Field]
    if kind == "age":
        parts = [head + "Applicant age: ", Field("age", old), " years\n"]
        rule = ("Applicants must be at least 18 years old on the date of the application. "
                "Applicants younger than 18 are denied, whatever their other circumstances.")
        ok = {v: int(v) >= 18 for v in (old, new)}
    else:
        parts = [head + "Residency status: ", Field("residency", old), "\n"]
        rule = ("Only applicants whose residency status is resident or citizen can be approved. "
                "Applicants whose status is visitor or nonresident are denied.")
        ok = {v: v in ("resident", "citizen") for v in (old, new)}
    doc = Document([
        *parts,
        f"Annual income: ${rng.randint(12, 95)},{rng.randint(100, 999)}\n"
        f"Household size: {rng.randint(1, 6)}\nSubmitted: {_date(rng)}\n",
        _record_lines(rng),
        f"\nELIGIBILITY RULES\n{rule} Income and household size only affect the amount awarded, "
        "never whether the application is approved. The reviewer records one decision: approved "
        "or denied.\n",
    ])
    word = {True: "approved", False: "denied"}
    return EditCase("eligibility", case_id, doc, kind, old, new,
                    "Should this application be approved or denied? Answer approved or denied.",
                    ("approved", "denied"), word[ok[old]], word[ok[new]])


@register_family("eligibility")
def eligibility_cases() -> list[EditCase]:
    pairs = [("17", "34"), ("42", "16"), ("15", "19"), ("21", "12"),
             ("visitor", "resident"), ("citizen", "nonresident")]
    return _cases("eligibility", _eligibility, pairs, 4)


# ---- membership: tier -> free express shipping ----------------------------------------------
_FREE_SHIPPING = {"Gold": True, "Platinum": True, "Silver": False, "Basic": False}


def _membership(rng: random.Random, old: str, new: str, case_id: str) -> EditCase:
    doc = Document([
        f"MEMBER PROFILE\nMember ID: M-{rng.randint(100000, 999999)}\nMembership tier: ",
        Field("tier", old),
        f"\nMember name: {_name(rng)}\nMember since: {_date(rng, rng.randint(2015, 2023))}\n"
        f"Orders this year: {rng.randint(1, 40)}\n",
        _record_lines(rng),
        "\nMEMBERSHIP BENEFITS\nGold and Platinum members get free express shipping on every "
        "order, priority support and early access to sales. Silver and Basic members pay $12.99 "
        "for express shipping and receive standard support. The benefit depends only on the "
        "membership tier listed in the profile, not on the number of orders.\n",
    ])
    yes = {True: "yes", False: "no"}
    return EditCase("membership", case_id, doc, "tier", old, new,
                    "Does this member get free express shipping? Answer yes or no.", ("yes", "no"),
                    yes[_FREE_SHIPPING[old]], yes[_FREE_SHIPPING[new]])


@register_family("membership")
def membership_cases() -> list[EditCase]:
    pairs = [("Gold", "Basic"), ("Basic", "Gold"), ("Platinum", "Silver"), ("Silver", "Platinum"),
             ("Gold", "Silver"), ("Basic", "Platinum")]
    return _cases("membership", _membership, pairs, 4)


# ---- scheduling: meeting day -> conflict with an unavailable participant ---------------------
def _scheduling(rng: random.Random, old: str, new: str, case_id: str) -> EditCase:
    person = _name(rng)
    off = _OFF_DAY[(old, new)]
    topic = rng.choice(["quarterly budget review", "product roadmap sync", "hiring debrief",
                        "vendor contract review", "security incident follow-up"])
    doc = Document([
        f"MEETING REQUEST\nTopic: {topic}\nScheduled day: ", Field("day", old),
        f"\nTime: {rng.randint(9, 16)}:00, 60 minutes\n"
        f"Room: {rng.choice('ABCDE')}-{rng.randint(10, 99)}\n"
        f"Organizer: {_name(rng)}\nRequired attendee: {person}\n",
        _record_lines(rng),
        f"\nAVAILABILITY\n{person} works part time and is not available on {off}s at all. On every "
        f"other weekday {person} is available for the whole day. A meeting has a conflict when it "
        f"is scheduled on a day the required attendee is not available.\n",
    ])
    yes = {True: "yes", False: "no"}
    return EditCase("scheduling", case_id, doc, "day", old, new,
                    "Does this meeting have a scheduling conflict? Answer yes or no.",
                    ("yes", "no"), yes[old == off], yes[new == off])


# (old day, new day) -> the day the required attendee is off: exactly one side conflicts
_OFF_DAY = {("Monday", "Wednesday"): "Monday", ("Thursday", "Monday"): "Monday",
            ("Friday", "Tuesday"): "Friday", ("Tuesday", "Friday"): "Friday",
            ("Monday", "Friday"): "Friday", ("Wednesday", "Thursday"): "Wednesday"}


@register_family("scheduling")
def scheduling_cases() -> list[EditCase]:
    return _cases("scheduling", _scheduling, list(_OFF_DAY), 4)


# ---- threshold: numeric reading -> alert or normal --------------------------------------------
_THRESHOLDS = [
    # field, label, unit, rule text, alert predicate, (old, new) pairs
    ("temperature", "Body temperature", " °C",
     "Any body temperature of 38.0 °C or higher means fever and must be marked alert.",
     lambda v: float(v) >= 38.0, [("39.1", "36.8"), ("37.0", "38.6")]),
    ("pressure", "Systolic blood pressure", " mmHg",
     "A systolic blood pressure of 140 mmHg or higher must be marked alert.",
     lambda v: float(v) >= 140, [("162", "118"), ("121", "151")]),
    ("stock", "Units in stock", " units",
     "When fewer than 50 units are in stock the item must be marked alert for reordering.",
     lambda v: float(v) < 50, [("12", "340"), ("275", "8")]),
]


def _threshold(rng: random.Random, old: str, new: str, case_id: str) -> EditCase:
    field, label, unit, rule, alert = next(t[:5] for t in _THRESHOLDS
                                           if (old, new) in t[5])
    subject = (f"Patient: {_name(rng)}\nWard: {rng.randint(1, 9)}{rng.choice('ABC')}\n"
               if field != "stock" else
               f"Item: SKU-{rng.randint(10000, 99999)}\nWarehouse: {rng.choice(_CITIES)}\n")
    doc = Document([
        f"MONITORING LOG {rng.randint(100, 999)}\n{label}: ", Field(field, old), f"{unit}\n",
        subject, f"Recorded: {_date(rng)} at {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}\n",
        _record_lines(rng),
        f"\nPROTOCOL\n{rule} Every other reading is marked normal. The mark depends only on the "
        f"{label.lower()} reading at the top of this log; the other lines are for reference.\n",
    ])
    mark = {True: "alert", False: "normal"}
    return EditCase("threshold", case_id, doc, field, old, new,
                    "Should this reading be marked alert or normal? Answer alert or normal.",
                    ("alert", "normal"), mark[alert(old)], mark[alert(new)])


@register_family("threshold")
def threshold_cases() -> list[EditCase]:
    pairs = [p for t in _THRESHOLDS for p in t[5]]
    return _cases("threshold", _threshold, pairs, 4)


# ---- access: role -> allow or deny ----------------------------------------------------------
_CAN_DELETE = {"admin": True, "owner": True, "viewer": False, "guest": False, "editor": False}


def _access(rng: random.Random, old: str, new: str, case_id: str) -> EditCase:
    project = rng.choice(["atlas", "harbor", "nimbus", "quarry", "sprout", "vector"])
    doc = Document([
        f"USER ACCOUNT\nUsername: {rng.choice(_FIRST).lower()}{rng.randint(10, 99)}\nRole: ",
        Field("role", old),
        f"\nProject: {project}\nTeam: {rng.choice(['platform', 'data', 'mobile', 'finance'])}\n"
        f"Two-factor authentication: {rng.choice(['enabled', 'enabled', 'disabled'])}\n",
        _record_lines(rng),
        f"\nACCESS POLICY\nOnly users whose role is admin or owner may delete the {project} "
        "project. Users with the role editor, viewer or guest can never delete it, even when "
        "two-factor authentication is enabled. Requests are answered allow or deny according to "
        "the role in the account record.\n",
    ])
    word = {True: "allow", False: "deny"}
    return EditCase("access", case_id, doc, "role", old, new,
                    "This user asks to delete the project. Answer allow or deny.",
                    ("allow", "deny"), word[_CAN_DELETE[old]], word[_CAN_DELETE[new]])


@register_family("access")
def access_cases() -> list[EditCase]:
    pairs = [("admin", "viewer"), ("viewer", "admin"), ("owner", "guest"), ("guest", "owner"),
             ("editor", "admin"), ("admin", "editor")]
    return _cases("access", _access, pairs, 4)


# ---- lookup: the answer is the field's value -------------------------------------------------
def _lookup(rng: random.Random, old: str, new: str, case_id: str) -> EditCase:
    others = [c for c in _CITIES if c not in (old, new)]
    answers = (old, new, *rng.sample(others, 2))
    doc = Document([
        f"SHIPMENT RECORD\nTracking number: 1Z{rng.randint(10**7, 10**8 - 1)}\n"
        "Dispatch warehouse: ", Field("warehouse", old),
        f"\nDestination: {rng.randint(10, 990)} {rng.choice(_STREETS)}, "
        f"{rng.choice(others)}\nWeight: {rng.randint(1, 30)} kg\n",
        _record_lines(rng),
        f"\nNOTES\nThe company runs warehouses in {', '.join(sorted(answers))}. Each shipment "
        "leaves from exactly one warehouse, the dispatch warehouse named in the record; the "
        "destination city plays no role in that choice.\n",
    ])
    return EditCase("lookup", case_id, doc, "warehouse", old, new,
                    "From which warehouse city does this shipment leave? "
                    "Answer with the city name.",
                    answers, old, new)


@register_family("lookup")
def lookup_cases() -> list[EditCase]:
    pairs = [("Denver", "Boston"), ("Austin", "Seattle"), ("Chicago", "Miami"),
             ("Phoenix", "Atlanta"), ("Portland", "Dallas"), ("Seattle", "Denver")]
    return _cases("lookup", _lookup, pairs, 4)
