"""What a ``serve-bench skills`` run sends: a library of skills to publish, and prompts of them.

- :class:`AirlinePrompts` (``--prompts airline``): the agent's airline policies and tool manual;
  each prompt is the system header, ``k`` of the skills (a random subset in random order) and
  ~100 tokens of a customer's question. No decision is read: fidelity compares tokens.
- :class:`BfclPrompts` (``--prompts bfcl``): BFCL v4's ``live_multiple`` development cases
  (read from the installed ``bfcl-eval`` package, as ``kvnotes-bench tools`` reads them): each
  candidate function's JSON description is a skill compiled behind the tool header, each prompt
  is a case's header, functions in its order, the question and the call opening
  ``{"name": "``. ``--prompts bfcl-multi_turn``: the ``multi_turn`` development cases the same
  way, each involved class's API manual (a few thousand tokens) one skill. The decision is the
  function name the greedy answer writes (up to its closing quote), compared with the exact
  prompt's and with BFCL's ground truth (a multi_turn case's: its first call). The cases are those
  ``kvnotes-bench tools`` picks (spread over the file, the same context limit), in its two
  halves: the guard's tau is chosen on the calibration half.

A prompt is a list of text parts (``ComposeClient``'s layout); :meth:`info` gives a BFCL
prompt's case id, half and accepted answers.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

from kvnotes.apps.agent.prompt import HEADER
from kvnotes.apps.agent.skills import skill_names, skill_text
from kvnotes.core.document import added_bos, encode
from kvnotes.core.errors import InvalidArgumentError, UnknownNameError
from kvnotes.serving.library.splice import PieceIndex, PieceInfo

if TYPE_CHECKING:
    from kvnotes.serving.skills import ServingSkills

PROMPT_SETS = ("airline", "bfcl", "bfcl-multi_turn")
# a BFCL prompt set's name -> the development set of ``kvnotes-bench tools`` it sends
BFCL_SETS = {"bfcl": "live_multiple", "bfcl-multi_turn": "multi_turn"}
# what a prompt is asked for: the benchmark's warm-up, the guard's tau, TTFT rows, fidelity
PURPOSES = ("warmup", "calibration", "ttft", "fidelity")

_NAMES = ("Ana Ruiz", "Tom Becker", "Mei Lin", "Omar Haddad", "Sofia Rossi", "Jonas Berg",
          "Priya Nair", "Lukas Novak", "Grace Okafor", "Hiro Tanaka")
_ISSUES = (
    "I booked a flight {when} and I need to cancel it because of a family emergency. I paid "
    "with a {pay}. Can I get my money back, and how long will it take?",
    "My checked bag arrived {when} with a broken handle and a torn side pocket. The flight "
    "was operated by you and I am a {tier} member. What compensation can I get?",
    "I want to change the name on my booking made {when}; my passport shows my married name. "
    "I also want to add extra legroom. What does that cost for a {tier} member?",
    "My flight was delayed by six hours {when} and I missed a connection. I was travelling "
    "with a {pay} booking. What are you obliged to give me under your policy?",
)
_WHEN = ("2 hours ago", "yesterday", "5 days ago", "3 weeks ago", "last month")
_PAY = ("credit card", "gift card", "travel certificate", "corporate account")
_TIER = ("regular", "silver", "gold")

Log = Callable[[str], None]


class PromptSet(Protocol):
    """A skill library and the prompts made of it (see the module doc)."""

    @property
    def name(self) -> str: ...

    @property
    def decides(self) -> bool:
        """Whether :meth:`decision` reads one from an answer."""

    def register(self, skills: ServingSkills, *, anchor: bool, log: Log) -> None:
        """Publish the library's header and skills to the server's folder."""

    def index(self, tokenizer: Any, *, anchor: bool) -> PieceIndex:
        """The pieces :meth:`register` publishes, as the server indexes them."""

    def requests(self, n: int, seed: int, purpose: str) -> list[list[str]]:
        """``n`` prompts for ``purpose`` (one of :data:`PURPOSES`)."""

    def decision(self, text: str) -> str | None:
        """The decision an answer's text makes (None: the set reads none)."""

    def info(self, parts: Sequence[str]) -> dict[str, Any]:
        """What is known of one prompt (a BFCL case's id, half and answers; else nothing)."""

    def describe(self) -> str:
        """One sentence for the report: what a request is."""


def skill_texts() -> dict[str, str]:
    """The airline library: the agent's policies and tool manual."""
    return {name: skill_text(name) for name in skill_names()}


def user_text(rng: random.Random) -> str:
    issue = rng.choice(_ISSUES).format(when=rng.choice(_WHEN), pay=rng.choice(_PAY),
                                       tier=rng.choice(_TIER))
    ref = f"{rng.choice('ABCDEFGH')}{rng.randint(10000, 99999)}"
    return (f"\n\nCustomer {rng.choice(_NAMES)} (booking {ref}, account {rng.randint(1000, 9999)})"
            f" writes: {issue} Please answer with the exact policy that applies and the next "
            "step you will take.\nAgent:")


def make_requests(n: int, k: int, seed: int) -> list[list[str]]:
    """``n`` airline prompts as parts: header, ``k`` skills (random subset and order), user
    text."""
    rng = random.Random(seed)
    skills = skill_texts()
    names = sorted(skills)
    out = []
    for _ in range(n):
        chosen = rng.sample(names, k)
        out.append([HEADER, *(skills[s] for s in chosen), user_text(rng)])
    return out


def register_skills(skills: ServingSkills, *, anchor: bool = True, log: Log = lambda s: None
                    ) -> None:
    """Publish the airline library: the system header as a piece, then every policy, compiled
    behind the header every request starts with (``anchor``) or alone."""
    _register(skills, HEADER, skill_texts(), anchor=anchor, log=log)


def library_index(tokenizer: Any, *, anchor: bool = True) -> PieceIndex:
    """The pieces :func:`register_skills` publishes, as the server indexes them (token ids and
    the position each was compiled at: behind BOS when the tokenizer adds one, skills behind
    the header when ``anchor``), for planning phased requests without reading the folder."""
    return _index(tokenizer, HEADER, skill_texts(), anchor=anchor)


def _register(skills: ServingSkills, header: str, texts: dict[str, str], *, anchor: bool,
              log: Log) -> None:
    skills.add(header, name="header")
    for name, text in texts.items():
        info = skills.add(text, name=name, after=header if anchor else None)
        log(f"skill {name}: {len(info)} tokens (first position {info.origin})")


def _index(tokenizer: Any, header_text: str, texts: dict[str, str], *, anchor: bool
           ) -> PieceIndex:
    bos = added_bos(tokenizer)
    index = PieceIndex()
    at = 0
    if bos is not None:
        index.add(PieceInfo("bos", "bos", (bos,), 0))
        at = 1
    header = tuple(encode(tokenizer, header_text))
    index.add(PieceInfo("header", "header", header, at))
    origin = at + len(header) if anchor else at
    for name, text in texts.items():
        index.add(PieceInfo(name, name, tuple(encode(tokenizer, text)), origin))
    return index


@dataclass(frozen=True)
class AirlinePrompts:
    """The airline library, ``k`` skills per prompt."""

    k: int = 4
    name: str = "airline"
    decides: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.k <= len(skill_names()):
            raise InvalidArgumentError(f"--k must be between 1 and {len(skill_names())} (the "
                                       f"library's skills), got {self.k}")

    def register(self, skills: ServingSkills, *, anchor: bool, log: Log) -> None:
        register_skills(skills, anchor=anchor, log=log)

    def index(self, tokenizer: Any, *, anchor: bool) -> PieceIndex:
        return library_index(tokenizer, anchor=anchor)

    def requests(self, n: int, seed: int, purpose: str) -> list[list[str]]:
        _check_purpose(purpose)
        return make_requests(n, self.k, seed)

    def decision(self, text: str) -> str | None:
        return None

    def info(self, parts: Sequence[str]) -> dict[str, Any]:
        return {}

    def describe(self) -> str:
        return (f"header + {self.k} of {len(skill_names())} airline skills (random subset, "
                "random order) + ~100 tokens of user text")


@dataclass(frozen=True)
class BfclCase:
    """One BFCL case as the server gets it: its parts, id, half and accepted answers."""

    id: str
    parts: tuple[str, ...]
    half: str  # "calibrate" | "evaluate" (as ``kvnotes-bench tools`` splits them)
    answers: tuple[str, ...]
    tokens: int


@dataclass
class BfclPrompts:
    """BFCL development cases, ``live_multiple`` or ``multi_turn`` (see the module doc)."""

    cases: list[BfclCase]
    header: str
    skills: dict[str, str]  # name -> text, every distinct function description or manual
    skipped: list[dict[str, Any]] = field(default_factory=list)
    name: str = "bfcl"
    decides: bool = True

    @property
    def set_name(self) -> str:
        return BFCL_SETS[self.name]

    def register(self, skills: ServingSkills, *, anchor: bool, log: Log) -> None:
        _register(skills, self.header, self.skills, anchor=anchor, log=lambda s: None)
        what = "function descriptions" if self.set_name == "live_multiple" else "API manuals"
        log(f"published the BFCL header and {len(self.skills)} {what} of {len(self.cases)} "
            "cases")

    def index(self, tokenizer: Any, *, anchor: bool) -> PieceIndex:
        return _index(tokenizer, self.header, self.skills, anchor=anchor)

    def requests(self, n: int, seed: int, purpose: str) -> list[list[str]]:
        """Calibration: the calibration half, in order; fidelity: every case, calibration half
        first (the cases ``kvnotes-bench tools`` measures); warm-up and TTFT rows: ``n`` cases
        drawn at random (repeats allowed once every case is used)."""
        _check_purpose(purpose)
        if purpose == "calibration":
            pool = [c for c in self.cases if c.half == "calibrate"]
            return [list(c.parts) for c in pool[:n]]
        if purpose == "fidelity":
            ordered = ([c for c in self.cases if c.half == "calibrate"]
                       + [c for c in self.cases if c.half == "evaluate"])
            return [list(c.parts) for c in ordered[:n]]
        rng = random.Random(seed)
        out: list[list[str]] = []
        while len(out) < n:
            batch = list(self.cases)
            rng.shuffle(batch)
            out += [list(c.parts) for c in batch[:n - len(out)]]
        return out

    def decision(self, text: str) -> str | None:
        return call_name(text)

    def info(self, parts: Sequence[str]) -> dict[str, Any]:
        case = self._by_parts.get(tuple(parts))
        if case is None:
            return {}
        return {"case": case.id, "half": case.half, "answers": list(case.answers)}

    @cached_property
    def _by_parts(self) -> dict[tuple[str, ...], BfclCase]:
        return {c.parts: c for c in self.cases}

    def describe(self) -> str:
        lens = sorted(c.tokens for c in self.cases)
        span = f"{lens[0]}-{lens[-1]} tokens" if lens else "no case"
        skill = ("each candidate function's JSON description" if self.set_name == "live_multiple"
                 else "each involved class's API manual")
        return (f"a BFCL {self.set_name} case: the tool header, {skill} (a skill), the question "
                f"and the call opening ({len(self.cases)} cases, {span}; {len(self.skipped)} "
                "skipped over the context limit)")


def same_decision(prompt_set: PromptSet, text: str | None, exact: str | None) -> bool:
    """Whether an answer makes the exact answer's decision; one that never closes the name is
    compared by its whole text, and a failed request (None) decides nothing."""
    if text is None or exact is None:
        return False
    mine, theirs = prompt_set.decision(text), prompt_set.decision(exact)
    return mine == theirs if mine is not None and theirs is not None else text == exact


def call_name(text: str) -> str | None:
    """The function name an answer to ``{"name": "`` writes: its text up to the closing quote
    (None when the answer never closes it)."""
    name, quote, _ = text.partition('"')
    return name if quote else None


def bfcl_prompts(tokenizer: Any, *, cases: int = 40, max_context: int = 2048,
                 answer_tokens: int = 16, name: str = "bfcl") -> BfclPrompts:
    """The cases ``kvnotes-bench tools --set S --cases N --max-context M`` runs (the same
    spread, the same skip rule and halves), as parts for the server; ``name`` is a key of
    :data:`BFCL_SETS` and picks S."""
    from kvnotes_bench.tools.data import load_cases, spread
    from kvnotes_bench.tools.prompt import case_prompt

    if cases < 1:
        raise InvalidArgumentError(f"--cases must be at least 1, got {cases}")
    if name not in BFCL_SETS:
        raise UnknownNameError("BFCL prompt set", name, tuple(BFCL_SETS))
    picked = spread(load_cases(BFCL_SETS[name]), cases)
    out: list[BfclCase] = []
    skipped: list[dict[str, Any]] = []
    texts: dict[str, str] = {}
    header = ""
    bos = 1 if added_bos(tokenizer) is not None else 0
    for i, case in enumerate(picked):
        prompt = case_prompt(tokenizer, case)
        header = prompt.header
        parts = (prompt.header, *prompt.skills, prompt.question + prompt.query)
        n = bos + sum(len(encode(tokenizer, p)) for p in parts)
        if n + answer_tokens > max_context:
            skipped.append({"case": case.id, "tokens": n})
            continue
        for doc, text in zip(case.skills, prompt.skills, strict=True):
            texts.setdefault(_skill_name(doc.name, text, texts, prefix=_PREFIX[name]), text)
        out.append(BfclCase(case.id, parts, "calibrate" if i % 2 == 0 else "evaluate",
                            case.answers, n))
    return BfclPrompts(cases=out, header=header, skills=texts, skipped=skipped, name=name)


_PREFIX = {"bfcl": "fn", "bfcl-multi_turn": "api"}


def _skill_name(function: str, text: str, known: dict[str, str], *, prefix: str = "fn") -> str:
    """A piece name for a function description (or a class's manual): its name, suffixed when
    two cases describe one of the same name differently (a manual less excluded functions)."""
    name, i = f"{prefix}-{function}", 2
    while name in known and known[name] != text:
        name, i = f"{prefix}-{function}-{i}", i + 1
    return name


def make_prompt_set(name: str, tokenizer: Any, *, k: int = 4, cases: int = 40,
                    max_context: int = 2048, answer_tokens: int = 16) -> PromptSet:
    """The prompt set called ``name`` (one of :data:`PROMPT_SETS`)."""
    if name == "airline":
        return AirlinePrompts(k)
    if name in BFCL_SETS:
        return bfcl_prompts(tokenizer, cases=cases, max_context=max_context,
                            answer_tokens=answer_tokens, name=name)
    raise UnknownNameError("prompt set", name, PROMPT_SETS)


def _check_purpose(purpose: str) -> None:
    if purpose not in PURPOSES:
        raise UnknownNameError("prompt purpose", purpose, PURPOSES)
