"""The soak's checks: what each completed answer may be, and which one it was.

Every answer of the soak is greedy and is compared token for token with answers kvnotes' engine
computes in the benchmark process (the same float32 notes the server splices). What an answer
may be depends on what the connector could have done with its prompt:

- ``exact``: an exact request (no splice salt) equals a prefill of the same ids.
- ``compose``: a spliced request whose skills all stayed valid equals
  ``engine.compose(parts, repair=0)``, each skill placed where the prompt puts it (the bare
  splice: the connector supplies the prompt's leading run of known pieces, vLLM computes the
  rest).
- ``cut``: a request planned while one of its skills was not indexed (deleted, not yet seen by
  the scheduler's rescan, or skipped as damaged when it was indexed) equals the composition of
  the pieces before that skill with the skill and everything after it computed as text: the
  leading run ends there.
- ``exact`` again, for a spliced request whose load failed (the skill deleted or damaged after
  it was planned): the connector writes nothing of a failed load and reports its blocks, vLLM
  (``kv_load_failure_policy: recompute``) computes them from the first failed block on. The
  soak gives each such request a tenant of its own, so nothing of it is in the prefix cache
  and that block is block 0: the whole prompt is computed, the exact answer.
- ``partial@c``: the composition's first ``c`` tokens (a block boundary) and the rest computed
  on top: a request preempted after its splice whose resumed load failed (its own first blocks
  still cached).

An answer that matches none of its allowed candidates is ``wrong``, unless it leaves the first
candidate at a step where the server's own top two log-probabilities lie within ``tie_tau``
and the candidate's token is the other one of the two (a near tie between two float
computations, reported apart). Nothing here starts a server; the engine side is
:class:`EngineOracle`, any object with :meth:`Oracle.candidates` stands in for it in tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvnotes.core.errors import InvalidArgumentError

SHARED_TENANTS = (None, "soak-a", "soak-b")  # the spliced requests' tenants (None: no tenant)

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine
    from kvnotes.core.notebook import Notebook

KINDS = ("spliced", "exact", "volatile")  # what a soak request is
DAMAGES = ("corrupt", "delete")
EVENT_KINDS = ("publish", *DAMAGES, "retire")
CANDIDATES = ("compose", "cut", "exact", "partial")


# ---- the skill events ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SkillEvent:
    """At ``t_s`` seconds into the run, volatile skill ``skill`` is published, damaged
    (``corrupt``: one byte of its tensors flipped in place; ``delete``: its file removed) or
    retired (no longer put in requests)."""

    t_s: float
    kind: str
    skill: int

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise InvalidArgumentError(f"skill event {self.kind!r}: use one of "
                                       f"{', '.join(EVENT_KINDS)}")


def event_schedule(duration_s: float, *, interval_s: float, damage_after_s: float,
                   retire_after_s: float, first_s: float) -> list[SkillEvent]:
    """One volatile skill per ``interval_s`` from ``first_s`` on: published, damaged
    ``damage_after_s`` later (corrupted and deleted in turn), retired ``retire_after_s`` after
    its publication; only cycles that end within ``duration_s``.

    Example:
        >>> [(e.t_s, e.kind) for e in event_schedule(30, interval_s=20, damage_after_s=5,
        ...                                          retire_after_s=10, first_s=2)]
        [(2, 'publish'), (7, 'corrupt'), (12, 'retire')]
    """
    if not 0 < damage_after_s < retire_after_s <= interval_s:
        raise InvalidArgumentError(
            f"skill events need 0 < damage after ({damage_after_s} s) < retire after "
            f"({retire_after_s} s) <= interval ({interval_s} s): one volatile skill at a time")
    events: list[SkillEvent] = []
    i, t = 0, first_s
    while t + retire_after_s <= duration_s:
        events += [SkillEvent(t, "publish", i),
                   SkillEvent(t + damage_after_s, DAMAGES[i % 2], i),
                   SkillEvent(t + retire_after_s, "retire", i)]
        i, t = i + 1, t + interval_s
    return events


def allowed(kind: str, *, damage: str | None = None, after_damage: bool = False
            ) -> tuple[str, ...]:
    """The candidates an answer of ``kind`` may equal, the expected one first.

    A volatile request sent after its skill's damage cannot be spliced whole any more (its
    tenant is its own, so no cache holds the skill's blocks); one sent before may still be
    loaded after it (it waits in the queue), so any outcome is allowed.
    """
    if kind not in KINDS:
        raise InvalidArgumentError(f"request kind {kind!r}: use one of {', '.join(KINDS)}")
    if kind == "exact":
        return ("exact",)
    if kind == "spliced":
        return ("compose",)
    if not after_damage:
        return ("compose", "cut", "exact", "partial")
    if damage == "delete":
        return ("cut", "exact", "partial")
    if damage == "corrupt":
        return ("exact", "cut", "partial")
    raise InvalidArgumentError(f"a volatile request after damage needs the damage kind "
                               f"({', '.join(DAMAGES)}), got {damage!r}")


# ---- the references --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Prompt:
    """A soak prompt as the engine rebuilds it: the header, skill names in order and the user
    text; ``volatile_at`` is where a volatile skill sits among the skills (None: none)."""

    skills: tuple[str, ...]
    user: str
    max_tokens: int
    volatile_at: int | None = None


class Oracle(Protocol):
    def candidates(self, prompt: Prompt, which: str) -> Iterator[tuple[str, list[int]]]:
        """``(label, greedy token ids)`` of each reference of kind ``which`` (one for
        compose, cut and exact; one per block boundary for partial)."""
        ...


class EngineOracle:
    """The references computed by kvnotes' engine, once per (prompt, candidate).

    Args:
        engine: the served model, loaded by kvnotes.
        header: the system header every prompt starts with (a piece at position 0).
        notebooks: each skill's compiled notebook by name (exactly what was published).
        texts: each skill's text by name (for the ``cut`` reference).
        block_size: the server's KV block size (the ``partial`` boundaries).
    """

    def __init__(self, engine: Engine, header: tuple[str, Notebook],
                 notebooks: Mapping[str, Notebook], texts: Mapping[str, str], *,
                 block_size: int) -> None:
        self.engine, self.block_size = engine, int(block_size)
        self.header_text, self.header = header
        self.notebooks, self.texts = notebooks, texts
        self._cache: dict[tuple[Prompt, str], list[int]] = {}
        self._exact: dict[tuple[str, ...], Notebook] = {}  # exact prefills of header + skills
        self.computed = 0  # references computed (cache misses), for the report

    def ids(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, laid out as the soak's client sends them."""
        from kvnotes.serving.planning.layout import prompt_ids

        return prompt_ids(self.engine.tokenizer, self.part_texts(prompt))

    def part_texts(self, prompt: Prompt) -> list[str]:
        return [self.header_text, *(self.texts[s] for s in prompt.skills), prompt.user]

    def candidates(self, prompt: Prompt, which: str) -> Iterator[tuple[str, list[int]]]:
        for label, make in self._makers(prompt, which):
            key = (prompt, label)
            if key not in self._cache:
                self.computed += 1
                self._cache[key] = make()
            yield label, self._cache[key]

    def warm(self, wanted: Sequence[tuple[Prompt, str]], *, batch: int = 16,
             say: Callable[[str], None] = lambda s: None) -> None:
        """Compute the ``compose``, ``cut`` and ``exact`` references of ``wanted`` in batches:
        each prompt's notebook is built alone (the skills spliced or their shared exact
        prefill, then its own text), the greedy answers of ``batch`` prompts are decoded
        together (one forward per step; equal to one at a time up to float error)."""
        import torch

        todo = sorted({(p, w) for p, w in wanted if w != "partial"
                       and (p, w) not in self._cache}, key=lambda pw: (pw[0].max_tokens, pw[1]))
        for i in range(0, len(todo), batch):
            rows = todo[i:i + batch]
            for n in sorted({p.max_tokens for p, _ in rows}):
                group = [(p, w) for p, w in rows if p.max_tokens == n]
                nbs = [self._row(p, w) for p, w in group]
                logits = torch.stack([self.engine.next_logits(nb) for nb in nbs])
                outs = self.engine.continue_greedy_batch(nbs, logits, n)
                for (p, w), out in zip(group, outs, strict=True):
                    self._cache[(p, w)] = list(out.token_ids)
                    self.computed += 1
            say(f"  references: {min(i + batch, len(todo))}/{len(todo)}")

    def _row(self, prompt: Prompt, which: str) -> Notebook:
        """The whole prompt's notebook as reference ``which`` computes it."""
        from kvnotes.core.document import encode

        e = self.engine
        if which == "exact":
            return e.extend(self._exact_prefix(prompt.skills), encode(e.tokenizer, prompt.user))
        if which == "compose":
            return self._composed(prompt)
        if which == "cut":
            return e.compose(self._cut_parts(prompt), repair=0)
        raise InvalidArgumentError(f"candidate {which!r}: only compose, cut and exact are "
                                   "built whole")

    def _cut_parts(self, prompt: Prompt) -> list[Any]:
        at = len(prompt.skills) if prompt.volatile_at is None else prompt.volatile_at
        return [self.header, *(self.notebooks[s] for s in prompt.skills[:at]),
                *(self.texts[s] for s in prompt.skills[at:]), prompt.user]

    def _makers(self, prompt: Prompt, which: str
                ) -> Iterator[tuple[str, Callable[[], list[int]]]]:
        e, n = self.engine, prompt.max_tokens
        if which in ("compose", "cut", "exact"):
            yield which, lambda: e.greedy(self._row(prompt, which), None, n).token_ids
        elif which == "partial":
            ids = self.ids(prompt)
            for c in range(self.block_size, len(ids), self.block_size):
                yield f"partial@{c}", self._partial(prompt, ids, c)
        else:
            raise InvalidArgumentError(f"candidate {which!r}: use one of {', '.join(CANDIDATES)}")

    def _exact_prefix(self, skills: tuple[str, ...]) -> Notebook:
        """The exact prefill of the header and ``skills``, each prefix computed once (prompts
        that share leading skills share their prefill, as a prefix cache would)."""
        from kvnotes.core.document import encode
        from kvnotes.serving.planning.layout import prompt_ids

        if skills not in self._exact:
            if not skills:
                nb = self.engine.prefill(prompt_ids(self.engine.tokenizer, [self.header_text]))
            else:
                nb = self.engine.extend(self._exact_prefix(skills[:-1]),
                                        encode(self.engine.tokenizer, self.texts[skills[-1]]))
            self._exact[skills] = nb
        return self._exact[skills]

    def _composed(self, prompt: Prompt) -> Notebook:
        # repair=0: the bare splice the connector does (the engine's default repairs)
        return self.engine.compose([self.header, *(self.notebooks[s] for s in prompt.skills),
                                    prompt.user], repair=0)

    def _partial(self, prompt: Prompt, ids: list[int], c: int) -> Callable[[], list[int]]:
        def make() -> list[int]:
            head = self._composed(prompt).slice(0, c)
            return self.engine.greedy(head, ids[c:], prompt.max_tokens).token_ids
        return make


# ---- one answer against its candidates -------------------------------------------------------
@dataclass
class Verdict:
    """What one answer was: ``ok`` (equal to ``matched``), ``near_tie`` or ``wrong`` (then
    ``diverged_at``, the expected token there and the server's margin at that step)."""

    status: str
    matched: str | None = None
    diverged_at: int | None = None
    expected: list[int] = field(default_factory=list)
    margin: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Verdict:
        return cls(status=d["status"], matched=d.get("matched"), diverged_at=d.get("diverged_at"),
                   expected=list(d.get("expected", [])), margin=d.get("margin"))


def trimmed(ids: Sequence[int], eos: Sequence[int]) -> list[int]:
    """``ids`` without a trailing end-of-sequence token (one side may report it, the other
    not)."""
    out = list(ids)
    while out and out[-1] in eos:
        out.pop()
    return out


def divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first step where ``a`` and ``b`` differ (the shorter one's length when one is a
    prefix of the other), None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def tie_margin(top: Sequence[Mapping[int, float]], step: int, got: Sequence[int],
               want: Sequence[int]) -> float | None:
    """The server's log-probability gap between its token and the reference's at ``step``, when
    both are among its top two there (None otherwise)."""
    if step >= len(top) or step >= len(got) or step >= len(want):
        return None
    lp = top[step]
    a, b = got[step], want[step]
    if a not in lp or b not in lp:
        return None
    return abs(lp[a] - lp[b])


def check(output: Sequence[int], top: Sequence[Mapping[int, float]], prompt: Prompt,
          kinds: Sequence[str], oracle: Oracle, *, eos: Sequence[int] = (),
          tie_tau: float = 0.05) -> Verdict:
    """The verdict on ``output`` (greedy ids; ``top``: the server's top log-probabilities per
    step) against the candidates ``kinds`` of ``prompt``, in order."""
    got = trimmed(output, eos)
    first: list[int] | None = None
    for which in kinds:
        for label, ref in oracle.candidates(prompt, which):
            want = trimmed(ref, eos)
            if first is None:
                first = want
            if want == got:
                return Verdict("ok", matched=label)
    if first is None:
        raise InvalidArgumentError("no candidate to check against: pass at least one kind")
    step = divergence(got, first)
    margin = None if step is None else tie_margin(top, step, got, first)
    status = "near_tie" if margin is not None and margin < tie_tau else "wrong"
    return Verdict(status, diverged_at=step, expected=first, margin=margin)
