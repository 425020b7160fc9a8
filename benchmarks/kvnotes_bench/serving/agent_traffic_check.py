"""The agent soak's check: every answer against the one reference its report describes.

The front answers each request with ``usage.kvnotes``
(:class:`~kvnotes.serving.protocol.UsageKvnotes`): its plan, whether the guard fired, and the
connector's report for each request it sent vLLM (the phases, then the one that answered:
:class:`~kvnotes.serving.protocol.SpliceReport`, the tokens vLLM's prefix cache held, the
ranges loaded and from which entry, the loads that failed). The check computes, with the
engine, greedy, stopping where the server stops (an end-of-sequence token, a stop string,
``max_tokens``), exactly ONE reference per answer, the computation the report describes
(:meth:`AgentOracle.reference`):

- ``exact``: a prefill of the whole prompt, for an answer sent exactly (no plan, ``splice:
  false``, or the guard fired: the answer is then the exact request's);
- ``reported``: the prompt walked in order, each loaded range's tokens from the very entry the
  connector names (kept while the run went, :class:`KeptEntries`: an entry evicted later is
  still read), placed at its range, every other token computed on top: a range supplied by a
  phase is in the answering request's local hit, a load that failed is recomputed from its
  first failed token, as vLLM does. Tokens held by the prefix cache before this request's own
  first phase (another request's blocks of the same salt) are taken as the plan lays them out;
  an answer that then differs is ``unchecked``, not ``wrong`` (``foreign`` says how many).

The prompt is rendered independently of the front
(:func:`~kvnotes_bench.serving.agent_traffic_render.rendered_prompt`): from the request and the
tokenizer alone, in the layout kvnotes documents for the model (its chat template; the kvnotes
tool block when the template ignores tools; the default layout without a template), cut at
each tool, content part and entry the report names, each part tokenized alone after BOS; a
front that renders or tokenizes a request otherwise gives another prompt, and the answer shows
as ``wrong`` (a prompt whose token count differs from the server's is ``wrong`` at once).

The server's answer is compared as the token strings of its log-probs with the strings vLLM
gives the reference's ids (:func:`served_strings`: a byte-fallback token of an unfinished UTF-8
character is ``""``, the token that completes it carries the character). An answer that differs
is ``wrong``, unless the server's top-2 log-probabilities lie within ``tie_tau`` at the first
differing step (``near_tie``, reported apart). With ``drift_tau`` (off by default) the greedy
paths are compared only up to the first step where either side's top-2 margin is below it
(:func:`drift_cut`). The oracle counts the references it computed (:attr:`AgentOracle.computed`,
one per checked answer).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvnotes.core.errors import KvnotesError
from kvnotes.serving.protocol import ProtocolError, UsageKvnotes
from kvnotes_bench.kit.records import Record
from kvnotes_bench.serving.agent_traffic_client import Answer
from kvnotes_bench.serving.agent_traffic_records import SoakRequestRecord
from kvnotes_bench.serving.agent_traffic_strings import served_strings

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine
    from kvnotes.core.notebook import Notebook
    from kvnotes.serving.library.splice import PieceInfo

class KeptEntries:
    """The library entries a run published, from the copies kept while it ran (a folder of
    hard links), indexed by their token ids."""

    def __init__(self, folder: Path, fingerprint: Any) -> None:
        from kvnotes.serving.library.piece_store import index_entry

        self.by_ids: dict[tuple[int, ...], list[tuple[PieceInfo, Path]]] = {}
        self.by_key: dict[str, Path] = {}
        self.pieces: dict[str, PieceInfo] = {}
        self.skipped = 0
        for path in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
            try:
                piece, _ = index_entry(path, fingerprint)
            except (KvnotesError, OSError):
                self.skipped += 1
                continue
            self.by_ids.setdefault(piece.token_ids, []).append((piece, path))
            self.by_key[piece.key] = path
            self.pieces[piece.key] = piece

    def __len__(self) -> int:
        return sum(len(v) for v in self.by_ids.values())

    def texts(self, usage: UsageKvnotes, tokenizer: Any) -> list[str]:
        """The texts of the kept entries ``usage`` names (its plan's entries, its reports'
        loaded ranges), in prompt order: where the front cut the prompt into parts."""
        keyed = {e.start: e.key for e in (usage.plan.entries if usage.plan else ())}
        for report in usage.reports:
            keyed.update({r.piece_start: r.key for r in report.loaded})
        out = []
        for _, key in sorted(keyed.items()):
            piece = self.pieces.get(key)
            if piece is not None and len(piece) > 1:
                out.append(str(tokenizer.decode(list(piece.token_ids))))
        return out


@dataclass(frozen=True)
class Source:
    """Where the notes of prompt tokens ``[start, end)`` come from: entry ``key`` placed at
    ``piece_start`` (``key`` None: computed on top of the notes before them)."""

    start: int
    end: int
    key: str | None = None
    piece_start: int = 0


def reported_sources(prompt_len: int, usage: UsageKvnotes) -> tuple[list[Source], int] | None:
    """The prompt's tokens by where their notes came from, as the reports say, and how many
    past the plan's first spliced piece were held by the prefix cache beyond what this
    request's own earlier phases made (another request's blocks, taken as the plan lays them
    out); None when a report is missing.

    Each request (the phases, then the one that answered) leaves the tokens of its local hit
    as the requests before it made them, and sets the rest of its prompt: its loaded ranges
    (before a failed load) from their entries, every other token computed.

    Example:
        >>> from kvnotes.serving.protocol import LoadedRange, SpliceReport
        >>> phase = SpliceReport(17, 0, (LoadedRange(0, 0, 8, "a"),))
        >>> real = SpliceReport(30, 16, (LoadedRange(8, 16, 29, "b"),))
        >>> usage = UsageKvnotes(phases=1, phase_reports=(phase,), report=real)
        >>> [(s.start, s.end, s.key) for s in reported_sources(30, usage)[0]]
        [(0, 8, 'a'), (8, 16, None), (16, 29, 'b'), (29, 30, None)]
    """
    reports = usage.reports
    if not reports:
        return None
    key: list[tuple[str, int] | None] = [None] * prompt_len
    if usage.plan is not None:  # what a foreign prefix holds, when it is the plan's layout
        names = {e.start: e.key for e in usage.plan.entries}
        for r in usage.plan.ranges:
            for t in range(r.start, min(r.end, prompt_len)):
                key[t] = (names.get(r.piece_start, ""), r.piece_start)
    # text before the first spliced piece is computed alike by every request of the salt:
    # only a hit past it holds notes another request may have spliced otherwise
    first = min((r.start for r in usage.plan.ranges if r.end - r.piece_start > 1),
                default=prompt_len) if usage.plan is not None else prompt_len
    made, foreign = 0, 0  # tokens [0, made) set by this request's own earlier requests
    for report in reports:
        foreign = max(foreign, report.local_hit - max(made, first))
        cut = report.recompute_from
        end = min(report.prompt_tokens, prompt_len)
        for t in range(report.local_hit, end):
            key[t] = None
        for lr in report.loaded:
            for t in range(lr.start, min(lr.end, end, cut if cut is not None else lr.end)):
                key[t] = (lr.key, lr.piece_start)
        made = max(made, end)
    out: list[Source] = []
    for t, k in enumerate(key):
        if out and (out[-1].key, out[-1].piece_start) == ((None, 0) if k is None else k) \
                and out[-1].end == t:
            out[-1] = Source(out[-1].start, t + 1, out[-1].key, out[-1].piece_start)
        else:
            out.append(Source(t, t + 1) if k is None else Source(t, t + 1, k[0], k[1]))
    return out, foreign


class AgentOracle:
    """The engine's reference for each of the agent soak's answers: one per answer, counted.

    Args:
        engine: the served model's engine (float32, as the entries are).
        entries: the run's kept library entries.
    """

    def __init__(self, engine: Engine, entries: KeptEntries) -> None:
        self.engine, self.entries = engine, entries
        self.computed = 0
        self._notebooks: dict[Path, Notebook] = {}
        # each spliced request's (salt, prompt ids, sources), in the order checked
        self.layouts: list[tuple[str, tuple[int, ...], list[Source]]] = []
        self.donor_index: int | None = None  # the layout the last reference took a hit from

    def greedy(self, nb: Notebook, query: Sequence[int] | None, n: int,
               stop: Sequence[str] = ()) -> Reference:
        """Greedy ids after ``query`` on top of ``nb`` with each step's top-2 logit gap (the
        log-probability margin), stopping as the server does: at an end-of-sequence token
        (kept), once the text contains one of ``stop`` (the token that completed it kept), or
        after ``n`` tokens."""
        import torch

        e = self.engine
        step = e.feed_query(nb, list(query) if query is not None else None)
        nb, logits = step.notebook, step.logits
        ids: list[int] = []
        margins: list[float] = []
        for _ in range(n):
            flat = logits.reshape(-1).float()
            token = int(flat.argmax())
            top = torch.topk(flat, 2).values
            ids.append(token)
            margins.append(float(top[0] - top[1]))
            if token in e.eos_ids or len(ids) == n:
                break
            if stop and any(s in e.decode(ids) for s in stop):
                break
            out = e.forward(nb, [token])
            nb, logits = out.notebook, out.logits
        return Reference("", ids, margins)

    def exact(self, ids: Sequence[int], n: int, stop: Sequence[str] = ()) -> Reference:
        """The greedy answer after a prefill of ``ids`` (BOS included as given)."""
        e = self.engine
        ref = self.greedy(e.prefill(list(ids[:-1]), bos=False), list(ids[-1:]), n, stop)
        self.computed += 1
        return Reference("exact", ref.ids, ref.margins)

    def _notebook(self, path: Path) -> Notebook:
        from kvnotes.core.notebook import Notebook

        if path not in self._notebooks:
            self._notebooks[path] = Notebook.load(path, self.engine)
        return self._notebooks[path]

    def reported(self, ids: Sequence[int], sources: Sequence[Source], n: int,
                 stop: Sequence[str] = ()) -> Reference | str:
        """The greedy answer when the prompt's notes come from ``sources`` (an entry's tokens
        from that entry, moved to its place; the rest computed on top, in order); a string
        saying why it cannot be computed (an entry not kept); :class:`PromptMismatch` when an
        entry's tokens are not the prompt's."""
        from kvnotes.core.notebook import Notebook

        e, ids = self.engine, [int(t) for t in ids]
        last = len(ids) - 1
        nb: Notebook | None = None
        for src in sources:
            start, end = src.start, min(src.end, last)
            if start >= end:
                continue
            if src.key is None:
                nb = e.prefill(ids[start:end], bos=False) if nb is None \
                    else e.forward(nb, ids[start:end]).notebook
                continue
            path = self.entries.by_key.get(src.key)
            piece = self.entries.pieces.get(src.key)
            if path is None or piece is None:
                return f"entry {src.key or '(unnamed)'} of prompt tokens [{start}, {end}) " \
                       "was not kept"
            ps = src.piece_start
            if list(piece.token_ids) != ids[ps:ps + len(piece)]:
                raise PromptMismatch(f"entry {src.key} was loaded at {ps}, and holds other "
                                     f"tokens than the prompt's [{ps}, {ps + len(piece)})")
            placed = self._notebook(path).moved_to(ps).slice(start - ps, end - ps)
            nb = placed if nb is None else Notebook.concat([nb, placed])
        if nb is None:
            return self.exact(ids, n, stop)
        ref = self.greedy(nb, ids[last:], n, stop)
        self.computed += 1
        return Reference("reported", ref.ids, ref.margins)

    def reference(self, ids: Sequence[int], usage: UsageKvnotes | None, n: int,
                  stop: Sequence[str] = ()) -> tuple[Reference | str, int]:
        """The one reference ``usage`` describes for a prompt of ``ids`` (see the module
        docstring), or why there is none; and the prefix-cache tokens another request made.

        Those tokens are taken from the earliest request checked before this one under the
        same salt whose prompt shares them (:meth:`donor`: vLLM keeps the first blocks
        computed for a token prefix and salt, so that request's layout is what the cache
        holds, unless they were evicted and written again), else as this plan lays them out.
        Each spliced request's layout is kept for the requests after it."""
        if usage is None or usage.plan is None or usage.guard_fired or not usage.spliced_tokens:
            return self.exact(ids, n, stop), 0
        found = reported_sources(len(ids), usage)
        if found is None:
            return "the connector's reports are missing (a streamed answer, or vLLM sent none)", 0
        sources, foreign = found
        salt, held = usage.plan.salt, foreign_end(len(ids), usage)
        self.donor_index = None
        if foreign and held:
            donor = self.donor(salt, ids, held)
            if donor is not None:
                self.donor_index = donor[0]
                sources = [*clip(donor[1], 0, held), *clip(sources, held, len(ids))]
        self.layouts.append((salt, tuple(int(t) for t in ids), sources))
        if not any(s.key is not None for s in sources):
            return self.exact(ids, n, stop), foreign
        return self.reported(ids, sources, n, stop), foreign

    def donor(self, salt: str, ids: Sequence[int], held: int
              ) -> tuple[int, list[Source]] | None:
        """``(index, sources)`` of the earliest kept layout of ``salt`` whose prompt shares the
        first ``held`` tokens of ``ids`` (its index in :attr:`layouts`)."""
        head = tuple(int(t) for t in ids[:held])
        for i, (s, other, sources) in enumerate(self.layouts):
            if s == salt and other[:held] == head:
                return i, sources
        return None


def foreign_end(prompt_len: int, usage: UsageKvnotes) -> int:
    """The end of the last prefix-cache hit that holds tokens another request made (0: none),
    by the rule of :func:`reported_sources`."""
    first = min((r.start for r in usage.plan.ranges if r.end - r.piece_start > 1),
                default=prompt_len) if usage.plan is not None else prompt_len
    made, end = 0, 0
    for report in usage.reports:
        if report.local_hit > max(made, first):
            end = report.local_hit
        made = max(made, min(report.prompt_tokens, prompt_len))
    return end


def clip(sources: Sequence[Source], start: int, end: int) -> list[Source]:
    """``sources`` cut to prompt tokens ``[start, end)``."""
    return [Source(max(s.start, start), min(s.end, end), s.key, s.piece_start)
            for s in sources if s.end > start and s.start < end]


# ---- one answer against its references ---------------------------------------------------------
@dataclass(frozen=True)
class Reference:
    """One candidate answer the engine computed: its greedy ``ids`` and each step's top-2
    log-probability margin."""

    label: str
    ids: list[int]
    margins: list[float] = field(default_factory=list)


@dataclass
class AgentVerdict(Record):
    """What one answer was (``ok``, ``near_tie``, ``wrong`` or ``unchecked``).

    ``matched``: the reference it equals; ``compared``: the steps compared (fewer than the
    answer's when the drift rule cut the comparison short: both sides agree up to a step where
    one of them is within ``drift_tau`` of a tie); against the first reference when none
    matched: ``diverged_at``, its ``expected`` ids, the server's ``margin`` and the engine's
    ``ref_margin`` at that step; ``margin_gap``: the largest difference between the server's
    and the matched reference's top-2 margins over the compared steps (float noise, ~1e-4, when
    the reference is the server's very computation; more when only the tokens agree); ``why``:
    why it is unchecked.
    """

    status: str
    matched: str | None = None
    compared: int | None = None
    cut: bool = False
    diverged_at: int | None = None
    expected: list[int] = field(default_factory=list)
    margin: float | None = None
    ref_margin: float | None = None
    ref_margins: list[float] = field(default_factory=list)  # the matched (else first) reference's
    margin_gap: float | None = None  # the largest |server - engine| margin over compared steps
    why: str | None = None


def _first_difference(a: Sequence[str], b: Sequence[str]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def drift_cut(server: Sequence[float | None], engine: Sequence[float], tau: float) -> int | None:
    """The first step where either side's top-2 margin is below ``tau`` (None: none): there a
    float32 computation on either side may pick the other token, and past it the two greedy
    paths are different texts, so they are compared only before it.

    Example:
        >>> drift_cut([3.0, 0.5, 0.01], [2.9, 0.6, 0.02], 0.1), drift_cut([3.0], [0.05], 0.1)
        (2, 0)
    """
    for i in range(max(len(server), len(engine))):
        for side in (server, engine):
            m = side[i] if i < len(side) else None
            if m is not None and m < tau:
                return i
    return None


def verdict(answer: Answer, refs: Iterable[Reference], tokenizer: Any, *,
            eos: Sequence[int], tie_tau: float, drift_tau: float | None = None) -> AgentVerdict:
    """The answer against its references in order: ``ok`` at the first equal one, else
    ``near_tie`` or ``wrong`` against the first.

    The server's token strings (its log-probs; its text when it sent none) are compared with
    :func:`served_strings` of the reference's ids, step by step (an end-of-sequence token at
    the end aside on both sides). With ``drift_tau``, a reference also matches when the two
    agree on every step before :func:`drift_cut` (``compared`` says how many steps; ``cut``).
    A mismatch is a ``near_tie`` when the server's margin at the first differing step is below
    ``tie_tau``.
    """
    eos_strings = {tokenizer.decode([int(t)]) for t in eos}
    got = list(answer.tokens)
    while got and got[-1] in eos_strings:
        got.pop()
    first: tuple[Reference, list[str], list[int]] | None = None
    for ref in refs:
        ids = list(ref.ids)
        while ids and ids[-1] in eos:
            ids.pop()
        want = served_strings(tokenizer, ids)
        if first is None:
            first = (ref, want, ids)
        if not got:
            if answer.text == tokenizer.decode(ids, skip_special_tokens=True):
                return AgentVerdict("ok", matched=ref.label, compared=len(ids),
                                    ref_margins=_rounded(ref.margins))
            continue
        if got == want:
            return AgentVerdict("ok", matched=ref.label, compared=len(got),
                                ref_margins=_rounded(ref.margins),
                                margin_gap=_gap(answer.margins, ref.margins, len(got)))
        if drift_tau is not None:
            cut = drift_cut(answer.margins, ref.margins, drift_tau)
            if cut is not None and got[:cut] == want[:cut]:
                return AgentVerdict("ok", matched=ref.label, compared=cut, cut=True,
                                    ref_margins=_rounded(ref.margins),
                                    margin_gap=_gap(answer.margins, ref.margins, cut))
    if first is None:
        return AgentVerdict("wrong", why="no reference")
    ref, want, ids = first
    step = _first_difference(got, want)
    margin = answer.margins[step] if step is not None and step < len(answer.margins) else None
    ref_margin = ref.margins[step] if step is not None and step < len(ref.margins) else None
    status = "near_tie" if margin is not None and margin < tie_tau else "wrong"
    return AgentVerdict(status, diverged_at=step, expected=ids, margin=margin,
                        ref_margin=ref_margin, ref_margins=_rounded(ref.margins))


def _gap(server: Sequence[float | None], engine: Sequence[float], steps: int) -> float | None:
    gaps = [abs(a - b) for a, b in zip(server[:steps], engine[:steps], strict=False)
            if a is not None]
    return max(gaps) if gaps else None


def _rounded(values: Sequence[float]) -> list[float]:
    return [round(float(v), 5) for v in values]


# ---- one soak request -------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckConfig:
    """How answers are checked: ``max_tokens`` greedy tokens, the model's ``eos`` ids, the
    near-tie threshold ``tie_tau`` and the drift threshold ``drift_tau`` (None: paths compared
    whole; see :func:`drift_cut`)."""

    max_tokens: int
    eos: tuple[int, ...] = ()
    tie_tau: float = 0.05
    drift_tau: float | None = None


def read_usage(value: Mapping[str, Any] | None) -> UsageKvnotes | None:
    """An answer's ``usage.kvnotes`` read as the protocol's message (None: none sent);
    :class:`~kvnotes.serving.protocol.ProtocolError` for one this version does not read."""
    return None if value is None else UsageKvnotes.from_dict(value)


def check_request(record: SoakRequestRecord, oracle: AgentOracle, tokenizer: Any,
                  config: CheckConfig) -> AgentVerdict:
    """The verdict on one answered request from its record: against the one reference its
    ``usage.kvnotes`` describes (:meth:`AgentOracle.reference`). ``wrong`` when the prompt the
    check rendered is not the one the front sent (another token count, or a loaded entry
    whose tokens are not the prompt's); ``unchecked`` when there is no reference (the prompt
    could not be rendered, a report is missing, an entry was not kept) or when a wrong answer
    stands on prefix-cache blocks another request made."""
    ids = record.prompt_ids
    if ids is None:
        return AgentVerdict("unchecked", why="the prompt could not be rendered")
    if record.prompt_tokens is not None and len(ids) != record.prompt_tokens:
        return AgentVerdict("wrong", why=f"the prompt differs: the chat template gives "
                            f"{len(ids)} tokens, the server counted {record.prompt_tokens}")
    try:
        usage = read_usage(record.usage)
    except ProtocolError as err:
        return AgentVerdict("unchecked", why=f"usage.kvnotes not read: {err}")
    try:
        ref, foreign = oracle.reference(ids, usage, config.max_tokens, record.stop)
    except PromptMismatch as err:
        return AgentVerdict("wrong", why=f"the prompt differs: {err}")
    if isinstance(ref, str):
        return AgentVerdict("unchecked", why=ref)
    v = verdict(record.answer(), [ref], tokenizer, eos=config.eos, tie_tau=config.tie_tau,
                drift_tau=config.drift_tau)
    if v.status != "ok" and foreign:
        taken = ("taken as the plan lays them out" if oracle.donor_index is None else
                 f"taken from the layout of the {oracle.donor_index + 1}th spliced request "
                 "that shares them")
        v.status, v.why = "unchecked", (f"the prefix cache held {foreign} tokens another "
                                        f"request made, {taken}")
    return v


class PromptMismatch(KvnotesError, ValueError):
    """A loaded entry whose tokens are not the rendered prompt's there: the front sent another
    prompt than the chat template gives."""
