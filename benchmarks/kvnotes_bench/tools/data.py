"""BFCL v4 development data, read from the installed ``bfcl-eval`` package (never downloaded).

Only two development sets may be read: ``live_multiple`` (each case lists its candidate
functions) and ``multi_turn`` (the API manuals of ``multi_turn_func_doc/``, the base cases'
``involved_classes``, and the first call of each case's first turn as its answer). Every other
BFCL category is held out for independent checks: :func:`category_file` refuses it by name
before any path is opened, so nothing here can read it by accident.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvnotes.core.errors import InvalidArgumentError

SETS = ("live_multiple", "multi_turn")
# BFCL's own class -> manual mapping (bfcl_eval/constants/executable_backend_config.py)
CLASS_MANUALS = {
    "GorillaFileSystem": "gorilla_file_system.json", "MathAPI": "math_api.json",
    "MessageAPI": "message_api.json", "TwitterAPI": "posting_api.json",
    "TicketAPI": "ticket_api.json", "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json", "VehicleControlAPI": "vehicle_control.json",
    "WebSearchAPI": "web_search.json", "MemoryAPI_kv": "memory_kv.json",
    "MemoryAPI_vector": "memory_vector.json", "MemoryAPI_rec_sum": "memory_rec_sum.json",
}
DEV_CATEGORIES = ("live_multiple", "multi_turn_base")


class HeldOutDataError(InvalidArgumentError):
    """A BFCL category outside the development sets was asked for: it stays unread."""


@dataclass(frozen=True, slots=True)
class SkillDoc:
    """One skill of a case: its text (what is compiled) and the functions it documents."""

    name: str
    text: str
    functions: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ToolCase:
    """One development case: the skills in the case's order, the chat turn, the right tools.

    ``system`` is the case's own system message (some live cases have one), ``question`` the
    user's first message, ``answers`` the function names BFCL's ground truth accepts first.
    """

    id: str
    set: str
    skills: tuple[SkillDoc, ...]
    question: str
    answers: tuple[str, ...]
    system: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def candidates(self) -> tuple[str, ...]:
        return tuple(f for s in self.skills for f in s.functions)


def data_root() -> Path:
    """The ``data`` folder of the installed ``bfcl-eval`` package (importing it needs none of
    its dependencies; only the package is located here)."""
    if importlib.util.find_spec("bfcl_eval") is None:
        raise InvalidArgumentError(
            "the BFCL data needs the bfcl-eval package: pip install --no-deps bfcl-eval "
            "(make install does it); nothing is downloaded at run time")
    return Path(str(importlib.resources.files("bfcl_eval") / "data"))


def category_file(root: Path, category: str, *, answers: bool = False) -> Path:
    """The case (or ``answers=True``: possible-answer) file of a development category.

    Raises :class:`HeldOutDataError` for every other category, before any path is touched.
    """
    if category not in DEV_CATEGORIES:
        raise HeldOutDataError(
            f"BFCL category {category!r} is held out for independent checks and is never read "
            f"here; the development categories are {', '.join(DEV_CATEGORIES)}")
    name = f"BFCL_v4_{category}.json"
    return root / "possible_answer" / name if answers else root / name


def manual_file(root: Path, class_name: str) -> Path:
    if class_name not in CLASS_MANUALS:
        raise InvalidArgumentError(f"unknown multi_turn class {class_name!r}; known: "
                                   f"{', '.join(sorted(CLASS_MANUALS))}")
    return root / "multi_turn_func_doc" / CLASS_MANUALS[class_name]


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def check_set(set_name: str) -> None:
    """Refuse anything but a development set's name (a held-out category with
    :class:`HeldOutDataError`), before any data or model is touched."""
    if set_name not in SETS:
        category = set_name.removeprefix("BFCL_v4_").removesuffix(".json")
        if category not in DEV_CATEGORIES:
            category_file(Path("."), category)  # raises HeldOutDataError, reads nothing
        raise InvalidArgumentError(f"unknown development set {set_name!r}; use one of "
                                   f"{', '.join(SETS)}")


def load_cases(set_name: str, root: Path | None = None) -> list[ToolCase]:
    """Every case of a development set (``live_multiple`` or ``multi_turn``), in file order."""
    check_set(set_name)
    root = data_root() if root is None else root
    if set_name == "live_multiple":
        return _live_multiple(root)
    return _multi_turn(root)


def _answer_names(ground_truth: list[dict[str, Any]]) -> tuple[str, ...]:
    # live cases: a list of {function_name: {arg: [accepted values]}}; the first call decides
    return tuple(ground_truth[0]) if ground_truth else ()


def _live_multiple(root: Path) -> list[ToolCase]:
    answers = {a["id"]: a["ground_truth"] for a in _lines(category_file(root, "live_multiple",
                                                                         answers=True))}
    cases = []
    for raw in _lines(category_file(root, "live_multiple")):
        turn = raw["question"][0]
        system = "\n".join(m["content"] for m in turn if m["role"] == "system")
        user = "\n".join(m["content"] for m in turn if m["role"] == "user")
        skills = tuple(SkillDoc(fn["name"], json.dumps(fn, ensure_ascii=False), (fn["name"],))
                       for fn in raw["function"])
        truth = answers.get(raw["id"], [])
        # BFCL's AST checker reads the raw descriptions and accepted values
        cases.append(ToolCase(raw["id"], "live_multiple", skills, user, _answer_names(truth),
                              system, meta={"functions": raw["function"],
                                            "ground_truth": truth}))
    return cases


_CALL = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")


def first_call_name(calls: list[str]) -> str | None:
    """The function name of the first call in a turn's ground truth (``"cd(folder='x')"``)."""
    for call in calls:
        m = _CALL.match(call)
        if m:
            return m.group(1)
    return None


def _manual(root: Path, class_name: str, excluded: set[str]) -> SkillDoc:
    functions = [fn for fn in _lines(manual_file(root, class_name)) if fn["name"] not in excluded]
    text = "\n".join(json.dumps(fn, ensure_ascii=False) for fn in functions)
    return SkillDoc(class_name, text, tuple(fn["name"] for fn in functions))


def _multi_turn(root: Path) -> list[ToolCase]:
    answers = {a["id"]: a["ground_truth"] for a in _lines(category_file(root, "multi_turn_base",
                                                                         answers=True))}
    cases = []
    for raw in _lines(category_file(root, "multi_turn_base")):
        excluded = set(raw.get("excluded_function") or ())
        skills = tuple(_manual(root, c, excluded) for c in raw["involved_classes"])
        turn = raw["question"][0]
        user = "\n".join(m["content"] for m in turn if m["role"] == "user")
        truth = answers.get(raw["id"], [[]])
        first = first_call_name(truth[0]) if truth else None
        cases.append(ToolCase(raw["id"], "multi_turn", skills, user,
                              (first,) if first else (), "",
                              {"involved_classes": list(raw["involved_classes"])}))
    return cases


def spread(cases: list[ToolCase], n: int) -> list[ToolCase]:
    """``n`` cases spread evenly over the file (all when ``n`` is 0 or at least their number),
    so a small run still meets many different function sets."""
    if n <= 0 or n >= len(cases):
        return list(cases)
    step = len(cases) / n
    return [cases[int(i * step)] for i in range(n)]
