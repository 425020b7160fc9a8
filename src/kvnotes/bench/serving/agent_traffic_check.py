"""The agent soak's check: every answer against kvnotes' engine, from what the front reported.

The front renders a chat request itself and reports in ``usage.kvnotes.plan`` what it
spliced: ``ranges`` (``[piece_start, start, end]``: prompt tokens ``[start, end)`` supplied from
the entry placed at ``piece_start``), its ``repair`` and ``block_size``. The check rebuilds the
prompt's token ids (:func:`render_ids`, which must give as many tokens as the server counted,
else the answer is ``unchecked``) and computes, with the engine, in order until one equals the
server's greedy answer:

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

An answer equal to none is ``wrong``, unless it leaves the first candidate where the server's
top-2 log-probabilities lie within ``tie_tau`` (``near_tie``, reported apart), as in the
soak (:mod:`kvnotes.bench.serving.soak_check`, whose :class:`Verdict` is reused).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvnotes.bench.serving.agent_traffic_client import Answer
from kvnotes.bench.serving.agent_traffic_requests import AgentRequest
from kvnotes.bench.serving.soak_check import Verdict
from kvnotes.core.errors import KvnotesError
from kvnotes.core.repair import Repair

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine
    from kvnotes.core.notebook import Notebook
    from kvnotes.serving.library.splice import PieceInfo

_REPAIR_TAG = re.compile(r"^f(\d+)a(\d+)(e?)$")


def render_ids(tokenizer: Any, request: AgentRequest) -> list[int]:
    """The token ids the front sends upstream for ``request``: the front's own reading of the
    chat body when it plans it (its ids, or its rendered text laid out as it lays out a chat
    prompt), else the model's chat template with the request's tools. The check compares the
    count with the server's ``prompt_tokens`` and leaves an answer unchecked when they differ.
    """
    from kvnotes.serving.planning.front_plan import strip_bos_text
    from kvnotes.serving.planning.layout import prompt_ids
    from kvnotes.serving.planning.request import Unplannable, read_request

    try:
        req = read_request("chat", {"model": "m", **request.body()}, tokenizer)
    except Unplannable:
        req = None
    if req is not None and req.ids is not None:
        return [int(t) for t in req.ids]
    if req is not None and req.text:
        text = req.text
    else:
        text = str(tokenizer.apply_chat_template(request.messages(), tools=request.tools(),
                                                 add_generation_prompt=True, tokenize=False))
    return prompt_ids(tokenizer, [strip_bos_text(tokenizer, text)])


def repair_of(tag: str) -> Repair | None:
    """The :class:`Repair` of a plan's ``repair`` tag (``f32a16``); None for a tag this check
    does not rebuild (a budget).

    Example:
        >>> r = repair_of("f32a16"); (r.first, r.align, r.skip_exact), repair_of("f8a1b4first")
        ((32, 16, True), None)
    """
    m = _REPAIR_TAG.match(tag or "")
    if not m:
        return None
    return Repair(first=int(m.group(1)), align=int(m.group(2)), skip_exact=not m.group(3))


class KeptEntries:
    """The library entries a run published, from the copies kept while it ran (a folder of
    hard links), indexed by their token ids."""

    def __init__(self, folder: Path, fingerprint: Any) -> None:
        from kvnotes.serving.library.piece_store import index_entry

        self.by_ids: dict[tuple[int, ...], list[tuple[PieceInfo, Path]]] = {}
        self.skipped = 0
        for path in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
            try:
                piece, _ = index_entry(path, fingerprint)
            except (KvnotesError, OSError):
                self.skipped += 1
                continue
            self.by_ids.setdefault(piece.token_ids, []).append((piece, path))

    def __len__(self) -> int:
        return sum(len(v) for v in self.by_ids.values())

    def matches(self, ids: Sequence[int], before: Sequence[int]) -> list[Path]:
        """Entries holding ``ids``, the one compiled behind a suffix of ``before`` (the
        prompt's tokens before the range) first."""
        found = self.by_ids.get(tuple(int(t) for t in ids), [])
        before = list(before)

        def rank(item: tuple[PieceInfo, Path]) -> int:
            behind = list(item[0].behind)
            return 0 if behind and before[-len(behind):] == behind else 1

        return [p for _, p in sorted(found, key=rank)]


class AgentOracle:
    """The engine's references for the agent soak's answers (each computed once).

    Args:
        engine: the served model's engine (float32, as the entries are).
        entries: the run's kept library entries.
    """

    def __init__(self, engine: Engine, entries: KeptEntries) -> None:
        self.engine, self.entries = engine, entries
        self.computed = 0
        self._cache: dict[tuple[Any, ...], list[int]] = {}
        self._notebooks: dict[Path, Notebook] = {}
        self._composed: dict[tuple[Any, ...], Notebook | None] = {}

    def _memo(self, key: tuple[Any, ...], make: Any) -> list[int]:
        if key not in self._cache:
            self._cache[key] = list(make())
            self.computed += 1
        return self._cache[key]

    def exact(self, ids: Sequence[int], n: int) -> list[int]:
        """Greedy ids after a prefill of ``ids`` (BOS included as given)."""
        e = self.engine
        return self._memo(("exact", tuple(ids), n), lambda: e.greedy(
            e.prefill(list(ids[:-1]), bos=False), list(ids[-1:]), n).token_ids)

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

    def composed(self, ids: Sequence[int], plan: Mapping[str, Any]) -> Notebook | None:
        """The prompt composed as the plan says (None: an entry is missing, the repair is not
        rebuilt here, a text span does not encode back, or the composition's tokens or repair
        regions are not the prompt's and the plan's); computed once per prompt and plan."""
        repair = repair_of(str(plan.get("repair", "")))
        if repair is None:
            return None
        e = self.engine
        ids = [int(t) for t in ids]
        bos = e.bos_id
        if bos is not None and ids[:1] != [bos]:
            return None  # compose starts with the BOS: the prompt must too
        ends: dict[int, int] = {}
        for value in plan.get("ranges") or []:
            ps, _, end = (int(v) for v in value)
            if bos is not None and ps == 0 and end == 1:
                continue  # the BOS entry: compose's own BOS is its prefill
            ends[ps] = max(end, ends.get(ps, end))
        parts: list[Any] = []
        pos = 0 if bos is None else 1
        for ps in sorted(ends):
            found = self.entries.matches(ids[ps:ends[ps]], ids[:ps])
            text = self.text_parts(ids[pos:ps]) if ps >= pos else None
            if not found or text is None:
                return None
            parts += text
            parts.append(self._notebook(found[0]))
            pos = ends[ps]
        tail = self.text_parts(ids[pos:])
        if tail is None:
            return None
        key = (tuple(ids), repr(plan))
        if key not in self._composed:
            nb = e.compose(parts + tail, repair=repair)
            # the composition must recompute what the plan had vLLM recompute: else it is not
            # the server's (e.g. an entry whose compiled prefix compose does not see)
            regions = plan.get("regions")
            same = nb.token_ids.tolist() == ids and (
                regions is None or [list(r) for r in regions] == nb.meta["compose"]["regions"])
            self._composed[key] = nb if same else None
        return self._composed[key]

    def candidates(self, ids: Sequence[int], plan: Mapping[str, Any] | None, n: int
                   ) -> Iterator[tuple[str, list[int]]]:
        """``(label, greedy ids)`` in order: compose, exact, partial@c (see the module doc);
        only exact without a plan."""
        composed = self.composed(ids, plan) if plan and plan.get("ranges") else None
        key = tuple(ids)
        if composed is not None:
            yield "compose", self._memo(("compose", key, n, repr(plan)),
                                        lambda: self.engine.greedy(composed, None, n).token_ids)
        yield "exact", self.exact(ids, n)
        if composed is not None:
            block = int((plan or {}).get("block_size") or 0)
            for c in range(block, len(ids), block) if block else ():
                yield f"partial@{c}", self._memo(
                    ("partial", key, n, c, repr(plan)),
                    lambda c=c: self.engine.greedy(composed.slice(0, c), list(ids[c:]),
                                                   n).token_ids)


def _first_difference(a: Sequence[str], b: Sequence[str]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _strings(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    return [tokenizer.decode([int(t)]) for t in ids]


def verdict(answer: Answer, refs: Iterator[tuple[str, list[int]]], tokenizer: Any, *,
            eos: Sequence[int], tie_tau: float) -> Verdict:
    """The answer against its candidates in order: ``ok`` at the first equal one, else
    ``near_tie`` or ``wrong`` against the first. The server's answer is compared as its token
    strings (log-probs; its text when it sent none) with the engine's ids decoded one by one."""
    eos_strings = {tokenizer.decode([int(t)]) for t in eos}
    got = list(answer.tokens)
    while got and got[-1] in eos_strings:
        got.pop()
    first: list[str] | None = None
    first_ids: list[int] = []
    for label, ref in refs:
        ids = list(ref)
        while ids and ids[-1] in eos:
            ids.pop()
        want = _strings(tokenizer, ids)
        if first is None:
            first, first_ids = want, ids
        same = (got == want or "".join(got) == "".join(want)) if got else \
            answer.text == tokenizer.decode(ids, skip_special_tokens=True)
        if same:
            return Verdict("ok", matched=label)
    if first is None:
        return Verdict("wrong")
    step = _first_difference(got, first)
    margin = None
    if step is not None and step < len(answer.margins):
        margin = answer.margins[step]
    status = "near_tie" if margin is not None and margin < tie_tau else "wrong"
    return Verdict(status, diverged_at=step, expected=first_ids, margin=margin)
