"""The agent soak's check: every answer against kvnotes' engine, from what the front reported.

The front renders a chat request itself and reports in ``usage.kvnotes.plan`` what it
spliced: ``ranges`` (``[piece_start, start, end]``: prompt tokens ``[start, end)`` supplied from
the entry placed at ``piece_start``), its ``repair`` (:meth:`Repair.tag`, e.g. the server's
default ``f32a128s0.1``) and ``block_size``. The check rebuilds the prompt as the front sends it
(:func:`rendered_prompt`: the front's own part-by-part layout, and the ``stop`` strings it adds,
``"\n\nUser:"`` for a base model's chat; it must give as many tokens as the server counted,
else the answer is ``unchecked``) and computes, with the engine, greedy, stopping where the
server stops (an end-of-sequence token, a stop string, ``max_tokens``), in order until one
equals the server's answer:

- ``compose``: the prompt composed from the very library entries the server spliced (copies kept
  while the run went, :class:`KeptEntries`: an entry evicted later is still read), its text
  computed in place, with the plan's repair (``Engine.compose``, the rule the front's plan
  follows); when several entries hold a range's tokens (one chunk compiled behind different
  prefixes), the one compiled behind the prompt's own preceding tokens comes first;
- ``exact``: a prefill of the whole prompt (also the only candidate of an answer that spliced
  nothing or was sent with ``splice: false``);
- ``partial@c``: the composition's first ``c`` tokens (a block boundary), the rest computed on
  top: a spliced request whose load failed from block ``c`` on (its entry evicted between the
  plan and the load), which the connector recomputes.

The server's answer is compared as the token strings of its log-probs with the strings vLLM
gives the reference's ids (:func:`served_strings`: a byte-fallback token of an unfinished UTF-8
character is ``""``, the token that completes it carries the character). An answer equal to none
is ``wrong``, unless it leaves the first candidate where the server's top-2 log-probabilities
lie within ``tie_tau`` (``near_tie``, reported apart). With ``drift_tau`` (off by default) the
greedy paths are compared only up to the first step where either side's top-2 margin is below
it (:func:`drift_cut`): past a near tie two float32 computations (vLLM's CPU kernels, the
engine's) may follow different, equally valid paths; the answers cut short are counted. An
answer that differs from every reference while its composition could not be rebuilt is
``unchecked``, with the reason (:meth:`AgentOracle.why_not`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvnotes.bench.serving.agent_traffic_client import Answer
from kvnotes.bench.serving.agent_traffic_records import SoakRequestRecord
from kvnotes.bench.serving.agent_traffic_requests import AgentRequest
from kvnotes.core.errors import KvnotesError
from kvnotes.core.repair import Repair

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine
    from kvnotes.core.notebook import Notebook
    from kvnotes.serving.library.splice import PieceInfo

# Repair.tag(): f<first>a<align>, e (exact placements repaired too), s<share> (the share floor);
# an adaptive rule (t...) or a budget (b...) is not rebuilt here
_REPAIR_TAG = re.compile(r"^f(\d+)a(\d+)(e?)(?:s(\d*\.?\d+(?:e-?\d+)?))?$")


@dataclass(frozen=True)
class Rendered:
    """A chat request as the front sends it upstream: its prompt ``ids``, the ``stop`` strings
    the answer ends at (the client's, else the front's default layout's) and where the ids came
    from (``front``: the front's own part-by-part layout; ``template``: the chat template
    rendered whole, as vLLM renders a request the front forwards)."""

    ids: list[int]
    stop: tuple[str, ...] = ()
    source: str = "front"


def rendered_prompt(tokenizer: Any, request: AgentRequest) -> Rendered:
    """What the front sends upstream for ``request``: its own reading of the chat body when it
    plans it (the ids laid out part by part, each tool and content part tokenized alone, as
    :func:`~kvnotes.serving.planning.front_plan.chat_parts` sends them; the sampling's
    ``stop``), else the model's chat template with the request's tools. The check compares the
    count with the server's ``prompt_tokens`` and leaves an answer unchecked when they differ.
    """
    from kvnotes.serving.planning.front_plan import strip_bos_text
    from kvnotes.serving.planning.layout import prompt_ids
    from kvnotes.serving.planning.request import Unplannable, read_request

    try:
        req = read_request("chat", {"model": "m", **request.body()}, tokenizer)
    except Unplannable:
        req = None
    stop = _stops(req.sampling.get("stop")) if req is not None else ()
    if req is not None and req.parts:
        return Rendered([int(t) for t in req.prompt_ids], stop)
    if req is not None and req.ids is not None:
        return Rendered([int(t) for t in req.ids], stop)
    if req is not None and req.text:
        return Rendered(prompt_ids(tokenizer, [strip_bos_text(tokenizer, req.text)]), stop)
    text = str(tokenizer.apply_chat_template(request.messages(), tools=request.tools(),
                                             add_generation_prompt=True, tokenize=False))
    return Rendered(prompt_ids(tokenizer, [strip_bos_text(tokenizer, text)]), stop, "template")


def _stops(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(str(s) for s in value or ())


def repair_of(tag: str) -> Repair | None:
    """The :class:`Repair` of a plan's ``repair`` tag (:meth:`Repair.tag`: ``f32a16``, with the
    share floor ``f32a128s0.1``, the server's default); None for a tag this check does not
    rebuild (an adaptive rule, a budget).

    Example:
        >>> r = repair_of("f32a128s0.1"); (r.first, r.align, r.skip_exact, r.share)
        (32, 128, True, 0.1)
        >>> repair_of("f8a1b4first"), repair_of("f32a1t0.2k32c0.25")
        (None, None)
    """
    m = _REPAIR_TAG.match(tag or "")
    if not m:
        return None
    return Repair(first=int(m.group(1)), align=int(m.group(2)), skip_exact=not m.group(3),
                  share=float(m.group(4) or 0.0))


class KeptEntries:
    """The library entries a run published, from the copies kept while it ran (a folder of
    hard links), indexed by their token ids."""

    def __init__(self, folder: Path, fingerprint: Any) -> None:
        from kvnotes.serving.library.piece_store import index_entry

        self.by_ids: dict[tuple[int, ...], list[tuple[PieceInfo, Path]]] = {}
        self.by_key: dict[str, Path] = {}
        self.skipped = 0
        for path in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
            try:
                piece, _ = index_entry(path, fingerprint)
            except (KvnotesError, OSError):
                self.skipped += 1
                continue
            self.by_ids.setdefault(piece.token_ids, []).append((piece, path))
            self.by_key[piece.key] = path

    def __len__(self) -> int:
        return sum(len(v) for v in self.by_ids.values())

    def matches(self, ids: Sequence[int], before: Sequence[int],
                key: str | None = None) -> list[Path]:
        """Entries holding ``ids`` placed after the prompt's tokens ``before``: the entry
        ``key`` first (the one the plan names: the connector loads that very entry, or
        computes the range), then the others in the order the server prefers them
        (:func:`~kvnotes.serving.library.splice.preferred`, the rule the front and the
        connector share: the longest shared suffix of its compile prefix with ``before``, then
        the one prefilled at that position, then the latest)."""
        from kvnotes.serving.library.splice import preferred

        left = list(self.by_ids.get(tuple(int(t) for t in ids), []))
        pos, before = len(before), [int(t) for t in before]
        out: list[Path] = []
        named = self.by_key.get(key) if key else None
        if named is not None and any(path == named for _, path in left):
            out.append(named)
            left = [(piece, path) for piece, path in left if path != named]
        while left:
            best = preferred([piece for piece, _ in left], pos, before)
            at = next(i for i, (piece, _) in enumerate(left) if piece is best)
            out.append(left.pop(at)[1])
        return out

    def variants(self, ids: Sequence[int], plan: Mapping[str, Any]) -> dict[int, int]:
        """Per piece start of the plan's ranges, how many kept entries hold its tokens."""
        out: dict[int, int] = {}
        for ps, _, end in (tuple(int(v) for v in r) for r in plan.get("ranges") or []):
            if end - ps > 1:
                out[ps] = max(out.get(ps, 0), len(self.by_ids.get(tuple(ids[ps:end]), [])))
        return out


class AgentOracle:
    """The engine's references for the agent soak's answers (each computed once).

    Args:
        engine: the served model's engine (float32, as the entries are).
        entries: the run's kept library entries.
    """

    def __init__(self, engine: Engine, entries: KeptEntries) -> None:
        self.engine, self.entries = engine, entries
        self.computed = 0
        self._cache: dict[tuple[Any, ...], Reference] = {}
        self._notebooks: dict[Path, Notebook] = {}
        self._composed: dict[tuple[Any, ...], Notebook | None] = {}
        self._why: dict[tuple[Any, ...], str] = {}

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

    def _memo(self, key: tuple[Any, ...], label: str, make: Any) -> Reference:
        if key not in self._cache:
            self._cache[key] = make()
            self.computed += 1
        ref = self._cache[key]
        return Reference(label, ref.ids, ref.margins)

    def exact(self, ids: Sequence[int], n: int, stop: Sequence[str] = ()) -> Reference:
        """The greedy answer after a prefill of ``ids`` (BOS included as given)."""
        e = self.engine
        return self._memo(("exact", tuple(ids), n, tuple(stop)), "exact", lambda: self.greedy(
            e.prefill(list(ids[:-1]), bos=False), list(ids[-1:]), n, stop))

    def _notebook(self, path: Path) -> Notebook:
        from kvnotes.core.notebook import Notebook

        if path not in self._notebooks:
            self._notebooks[path] = Notebook.load(path, self.engine)
        return self._notebooks[path]

    def text_parts(self, ids: Sequence[int]) -> list[str] | None:
        """``ids`` as compose text parts that encode back to exactly ``ids`` (each part is
        tokenized alone, as the front tokenizes a prompt's parts): the whole decoded, else its
        halves, recursively; None when a single token does not come back."""
        ids = [int(t) for t in ids]
        if not ids:
            return []
        text = self.engine.tokenizer.decode(ids)
        if text and self.engine.tokens_of(text, bos=False)[0] == ids:
            return [text]
        if len(ids) == 1:
            return None
        mid = len(ids) // 2
        left, right = self.text_parts(ids[:mid]), self.text_parts(ids[mid:])
        return None if left is None or right is None else left + right

    def composed(self, ids: Sequence[int], plan: Mapping[str, Any],
                 variant: tuple[int, int] | None = None) -> Notebook | None:
        """The prompt composed as the plan says (None: see :meth:`why_not`), each range from
        the entry the server prefers, or, with ``variant`` ``(piece_start, k)``, the range
        at ``piece_start`` from its ``k``-th preferred entry (the preferred one may have been
        evicted, or not yet published, when the request was planned); computed once each."""
        key = (tuple(int(t) for t in ids), repr(plan), variant)
        if key not in self._composed:
            nb, why = self._compose(list(key[0]), plan, variant)
            self._composed[key] = nb
            self._why[key] = why
        return self._composed[key]

    def why_not(self, ids: Sequence[int], plan: Mapping[str, Any]) -> str | None:
        """Why the plan's composition of ``ids`` could not be rebuilt (None: it was)."""
        self.composed(ids, plan)
        return self._why.get((tuple(int(t) for t in ids), repr(plan), None)) or None

    def _compose(self, ids: list[int], plan: Mapping[str, Any],
                 variant: tuple[int, int] | None) -> tuple[Notebook | None, str]:
        repair = repair_of(str(plan.get("repair", "")))
        if repair is None:
            return None, f"repair {plan.get('repair')!r} is not rebuilt by the check"
        e = self.engine
        bos = e.bos_id
        if bos is not None and ids[:1] != [bos]:
            return None, "the prompt does not start with the BOS compose starts with"
        ends: dict[int, int] = {}
        for value in plan.get("ranges") or []:
            ps, _, end = (int(v) for v in value)
            if bos is not None and ps == 0 and end == 1:
                continue  # the BOS entry: compose's own BOS is its prefill
            ends[ps] = max(end, ends.get(ps, end))
        keys = {int(e["start"]): str(e["key"]) for e in plan.get("entries") or []
                if e.get("key")}
        parts: list[Any] = []
        pos = 0 if bos is None else 1
        for ps in sorted(ends):
            found = self.entries.matches(ids[ps:ends[ps]], ids[:ps], keys.get(ps))
            if not found:
                return None, f"no kept entry holds prompt tokens [{ps}, {ends[ps]})"
            text = self.text_parts(ids[pos:ps]) if ps >= pos else None
            if text is None:
                return None, f"prompt tokens [{pos}, {ps}) do not encode back as text"
            parts += text
            k = variant[1] if variant is not None and variant[0] == ps else 0
            if k >= len(found):
                return None, f"no {k}-th kept entry holds prompt tokens [{ps}, {ends[ps]})"
            parts.append(self._notebook(found[k]))
            pos = ends[ps]
        tail = self.text_parts(ids[pos:])
        if tail is None:
            return None, f"prompt tokens [{pos}, {len(ids)}) do not encode back as text"
        nb = e.compose(parts + tail, repair=repair)
        # the composition must recompute what the plan had vLLM recompute: else it is not
        # the server's (e.g. an entry whose compiled prefix compose does not see)
        if nb.token_ids.tolist() != ids:
            return None, "the composition's tokens are not the prompt's"
        regions = plan.get("regions")
        if regions is not None and [list(r) for r in regions] != nb.meta["compose"]["regions"]:
            return None, (f"the composition repairs {nb.meta['compose']['regions']}, the plan "
                          f"{[list(r) for r in regions]}")
        return nb, ""

    def candidates(self, ids: Sequence[int], plan: Mapping[str, Any] | None, n: int,
                   stop: Sequence[str] = (), cached: Sequence[CachedPrefix] = ()
                   ) -> Iterator[Reference]:
        """The references in order: compose, exact, partial@c, then one per ``cached``
        prefix (see the module doc); only exact without a plan."""
        composed = self.composed(ids, plan) if plan and plan.get("ranges") else None
        key = (tuple(ids), n, tuple(stop), repr(plan))
        if composed is not None:
            yield self._memo(("compose", *key), "compose",
                             lambda: self.greedy(composed, None, n, stop))
        yield self.exact(ids, n, stop)
        if composed is None or plan is None:
            return
        for ps, count in sorted(self.entries.variants(ids, plan).items()):
            for k in range(1, count):
                other = self.composed(ids, plan, (ps, k))
                if other is not None:
                    yield self._memo(("variant", ps, k, *key), f"compose@{ps}v{k}",
                                     lambda nb=other: self.greedy(nb, None, n, stop))
        block = int(plan.get("block_size") or 0)
        for c in range(block, len(ids), block) if block else ():
            yield self._memo(("partial", c, *key), f"partial@{c}",
                             lambda c=c: self.greedy(composed.slice(0, c), ids[c:], n, stop))
        for src in cached:
            prefix = self._prefix(src)
            if prefix is not None:
                yield self._memo(("cached", src.label, *key), src.label,
                                 lambda p=prefix: self._on_cached(p, ids, plan, composed, n, stop))

    def _prefix(self, src: CachedPrefix) -> Notebook | None:
        """The notes of ``src``'s first ``src.tokens`` tokens as its request computed them."""
        ids = list(src.ids[:src.tokens])
        if src.plan is None:
            return self.engine.prefill(ids, bos=False)
        nb = self.composed(src.ids, src.plan)
        return None if nb is None else nb.slice(0, src.tokens)

    def _on_cached(self, prefix: Notebook, ids: Sequence[int], plan: Mapping[str, Any],
                   composed: Notebook, n: int, stop: Sequence[str]) -> Reference:
        """The answer when vLLM's prefix cache holds ``prefix`` (another request's notes of
        the same first tokens): from there on, the plan's loaded tokens (``[start, end)`` of
        each range) are the composition's (an entry's notes do not depend on what precedes
        them), every other token is computed on top, as vLLM computes it."""
        from kvnotes.core.notebook import Notebook

        e = self.engine
        loaded = [(max(int(r[1]), len(prefix)), int(r[2])) for r in plan.get("ranges") or []]
        nb, pos, last = prefix, len(prefix), len(ids) - 1
        for start, end in sorted((a, b) for a, b in loaded if b > a):
            if start > pos:
                nb = e.forward(nb, list(ids[pos:min(start, last)])).notebook
                pos = min(start, last)
            if pos < min(end, last):
                nb = Notebook.concat([nb, composed.slice(pos, min(end, last))])
                pos = min(end, last)
        if pos < last:
            nb = e.forward(nb, list(ids[pos:last])).notebook
        return self.greedy(nb, list(ids[last:]), n, stop)


@dataclass(frozen=True)
class CachedPrefix:
    """An earlier request of the same cache salt whose first ``tokens`` tokens (whole blocks)
    are the prompt's own: vLLM's prefix cache may hold its notes of them (``plan`` None: it
    computed them exactly; else its composition)."""

    label: str
    ids: list[int]
    plan: dict[str, Any] | None
    tokens: int


def cached_prefixes(ids: Sequence[int], plan: Mapping[str, Any],
                    earlier: Iterable[tuple[int, Sequence[int], Mapping[str, Any]]]
                    ) -> list[CachedPrefix]:
    """The prefixes vLLM's prefix cache may hold for a spliced prompt ``ids`` from ``earlier``
    requests (``(index, ids, plan)``, sent before it): those of the same cache salt sharing
    whole blocks past the plan's first loaded token (the blocks before it are computed text
    either way), longest first. An earlier request whose own ranges all start past the shared
    blocks computed them exactly.

    Example:
        >>> plan = {"salt": "s", "block_size": 4, "ranges": [[2, 2, 9]]}
        >>> other = {"salt": "s", "block_size": 4, "ranges": [[9, 9, 12]]}
        >>> [(c.label, c.tokens, c.plan) for c in cached_prefixes(
        ...     list(range(12)), plan, [(3, list(range(10)) + [0, 0], other)])]
        [('cached@8:3', 8, None)]
    """
    block = int(plan.get("block_size") or 0)
    salt = plan.get("salt")
    starts = [int(r[1]) for r in plan.get("ranges") or [] if int(r[2]) - int(r[0]) > 1]
    if not block or not starts:
        return []
    first = min(starts)
    out: list[CachedPrefix] = []
    for index, other, their in earlier:
        if their.get("salt") != salt:
            continue
        common = 0
        for a, b in zip(ids, other, strict=False):
            if a != b:
                break
            common += 1
        c = min(common, len(ids) - 1) // block * block
        if c <= first:
            continue
        exact = all(int(r[1]) >= c for r in their.get("ranges") or []
                    if int(r[2]) - int(r[0]) > 1)
        out.append(CachedPrefix(f"cached@{c}:{index}", [int(t) for t in other],
                                None if exact else dict(their), c))
    return sorted(out, key=lambda x: -x.tokens)


# ---- the server's token strings ----------------------------------------------------------------
def _space_marker(tokenizer: Any) -> str | None:
    """The Metaspace replacement character whose leading instances ``decode`` strips (a
    SentencePiece tokenizer's ``▁``), as vLLM reads it; None for byte-level tokenizers."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        pre = (json.loads(backend.to_str()).get("pre_tokenizer") or {}) if backend else {}
    except (ValueError, AttributeError):
        return None
    subs = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    for sub in subs:
        if (sub or {}).get("type") == "Metaspace":
            return str(sub.get("replacement", "\u2581"))
    return None


def _single(tokenizer: Any, token: int, marker: str | None) -> str:
    text = tokenizer.decode([token]) or ""
    if marker is None:
        return str(text)
    raw = str((tokenizer.convert_ids_to_tokens([token]) or [""])[0] or "")
    lead = len(raw) - len(raw.lstrip(marker))
    missing = lead - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else str(text)


def served_strings(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """The token strings vLLM reports in the log-probs of an answer of ``ids``: each token
    decoded alone (a SentencePiece token's leading spaces restored); a token whose text ends in
    an unfinished UTF-8 sequence (U+FFFD, a byte-fallback token) is decoded with up to 4
    preceding answer tokens as context: ``""`` while the character is unfinished, the whole
    character on the token that completes it. Comparing these with the server's strings, not
    each id decoded alone, is what makes a multi-byte answer (Korean, Hindi) comparable.

    Example:
        >>> class Bytes:  # ids are UTF-8 bytes
        ...     def decode(self, ids): return bytes(ids).decode(errors="replace")
        >>> served_strings(Bytes(), list("스a".encode()))
        ['', '', '스', 'a']
    """
    marker = _space_marker(tokenizer)
    out: list[str] = []
    for i, token in enumerate(int(t) for t in ids):
        text = _single(tokenizer, token, marker)
        if text.endswith("\ufffd"):
            text = _completed(tokenizer, [int(t) for t in ids[max(0, i - 4):i]], token)
        out.append(text)
    return out


def _completed(tokenizer: Any, context: list[int], token: int) -> str:
    """vLLM's correction of a byte-fallback token's string from the answer's preceding tokens."""
    for n in range(1, len(context) + 1):
        ctx = context[-n:]
        full = str(tokenizer.decode(ctx + [token]))
        if full.endswith("\ufffd"):
            continue
        clean = len(ctx)
        for j in range(len(ctx) - 1, -1, -1):
            if str(tokenizer.decode([ctx[j]])).endswith("\ufffd"):
                clean = j
            else:
                break
        prefix = str(tokenizer.decode(ctx[:clean])) if clean else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        common = 0
        for a, b in zip(prefix, full, strict=False):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""


# ---- one answer against its references ---------------------------------------------------------
@dataclass(frozen=True)
class Reference:
    """One candidate answer the engine computed: its greedy ``ids`` and each step's top-2
    log-probability margin."""

    label: str
    ids: list[int]
    margins: list[float] = field(default_factory=list)


@dataclass
class AgentVerdict:
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AgentVerdict:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


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


def check_request(record: SoakRequestRecord, oracle: AgentOracle, tokenizer: Any,
                  config: CheckConfig, others: Sequence[SoakRequestRecord] = ()
                  ) -> AgentVerdict:
    """The verdict on one answered request from its record: ``unchecked`` when its prompt
    could not be rebuilt or has another token count than the server's, or when it differs
    from every reference and its spliced composition could not be rebuilt (no reference to
    call it wrong); else :func:`verdict` against compose / exact / partial@c / cached@c
    (``others``: the run's other requests; those sent before it, spliced under the same salt,
    are the prefixes the prefix cache may hold: :func:`cached_prefixes`)."""
    ids = record.prompt_ids
    if ids is None:
        return AgentVerdict("unchecked", why="the prompt could not be rebuilt")
    if record.prompt_tokens is not None and len(ids) != record.prompt_tokens:
        return AgentVerdict("unchecked", why=f"rebuilt {len(ids)} prompt tokens, the server "
                            f"counted {record.prompt_tokens}")
    plan = record.plan if record.spliced_tokens else None
    cached = cached_prefixes(ids, plan, [
        (o.index, o.prompt_ids, o.plan) for o in others
        if o.sent_s < record.sent_s and o.plan and o.spliced_tokens and o.prompt_ids
        and o.index != record.index]) if plan else []
    v = verdict(record.answer(), oracle.candidates(ids, plan, config.max_tokens, record.stop,
                                                   cached),
                tokenizer, eos=config.eos, tie_tau=config.tie_tau, drift_tau=config.drift_tau)
    if v.status != "ok" and plan and plan.get("ranges"):
        why = oracle.why_not(ids, plan)
        if why:
            v.status, v.why = "unchecked", f"the spliced composition was not rebuilt: {why}"
    return v
