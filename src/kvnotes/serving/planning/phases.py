"""Phased prefill: boundary repair of spliced skills inside a stock vLLM server.

vLLM takes one contiguous run of external tokens per request, right after its local
prefix-cache hit, so a request cannot say "splice this skill but compute its first 32 tokens".
A sequence of requests can: each *phase* is the prompt cut just after one recomputed region
(``max_tokens=1``, its answer discarded), sent with the same salt; the connector supplies the
pieces before the region, vLLM computes the region in context and keeps its blocks; the next
phase (or the real request) then hits those blocks locally, and the connector supplies the rest
of the piece from that hit on. Regions end on block boundaries (``repaired_end`` with
``align`` = the server's block size), since only whole blocks are prefix-cache hits.

The repair rule is :mod:`kvnotes.core.repair_plan`'s, the one ``Engine.compose`` executes: each
spliced piece's first ``max(first, ceil(share * len))`` tokens are recomputed in order, except
the pieces whose notes are
already a prefill's (``skip_exact``): an entry that records what it was prefilled behind (a
variant, ``PieceInfo.behind``) placed at its origin right behind those very tokens, every note
before it exact, as ``Engine.compose`` decides it; an entry that records nothing, in the
unbroken chain at their own origins from token 0 (BOS, the header, the first skill compiled
behind it).

Everything here is pure (no vLLM, no engine, no HTTP): :func:`plan_phases` turns a prompt's
part layout into a :class:`PhasePlan`, whose builders give the ``/v1/completions`` bodies that
:class:`~kvnotes.serving.compose_client.ComposeClient` and the OpenAI front send alike.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.repair import Repair, prefix_digest
from kvnotes.core.repair_plan import Part as LayoutPart
from kvnotes.core.repair_plan import Piece, Text, plan_repair
from kvnotes.serving.json_types import UpstreamBody
from kvnotes.serving.library.manifest import splice_salt
from kvnotes.serving.library.splice import PieceIndex, SpliceRange
from kvnotes.serving.planning.layout import SentPart
from kvnotes.serving.protocol import PlanEntry, SpliceRequest, WirePlan

# How many top log-probs the guarded real request asks for (the first token's margin).
GUARD_LOGPROBS = 2


@dataclass(frozen=True, slots=True)
class PartSpan:
    """Prompt tokens ``[start, end)`` of one part: a registered piece compiled at ``origin``
    (the position its first token was prefilled at), or text vLLM computes (``origin=None``).

    ``ids``: the part's token ids (None: not known; then no later piece can be told exactly
    placed by its prefix); ``behind``: the ids the piece was prefilled behind (its variant's
    prefix; () when the entry does not record it, then it is trusted at its origin behind a
    chain of pieces, ``trust_chain``); ``key``: the entry's key ("" when not known: the
    server then picks among the entries holding these tokens by its own rule)."""

    start: int
    end: int
    origin: int | None = None
    name: str = ""
    ids: tuple[int, ...] | None = None
    behind: tuple[int, ...] = ()
    key: str = ""

    @property
    def is_piece(self) -> bool:
        return self.origin is not None

    def __len__(self) -> int:
        return self.end - self.start


def part_spans(part_ids: Sequence[Sequence[int]], index: PieceIndex) -> list[PartSpan]:
    """The layout of a prompt sent part by part (``part_ids``: each part's token ids, BOS as a
    part of its own when the tokenizer adds one): a part whose tokens are exactly a registered
    piece's is that piece (the one :meth:`PieceIndex.match_exact` prefers), any other is text.

    Example:
        >>> from kvnotes.serving.library.splice import PieceInfo
        >>> idx = PieceIndex(); idx.add(PieceInfo("k", "refunds", (5, 6, 7), 0))
        >>> [(s.start, s.end, s.origin) for s in part_spans([[5, 6, 7], [9, 9]], idx)]
        [(0, 3, 0), (3, 5, None)]
    """
    ids = [int(t) for part in part_ids for t in part]
    sent: list[SentPart] = []
    pos = 0
    for part in part_ids:
        end = pos + len(part)
        sent.append(SentPart(tuple(ids[pos:end]), index.match_exact(ids, pos, end)))
        pos = end
    return sent_spans(sent)


def sent_spans(parts: Sequence[SentPart]) -> list[PartSpan]:
    """The layout of a prompt whose parts already say which piece each one is (the front's
    match carries them; :func:`part_spans` finds them for raw parts). Empty parts take no span.

    Example:
        >>> from kvnotes.serving.library.splice import PieceInfo
        >>> p = PieceInfo("k", "refunds", (5, 6, 7), 0)
        >>> [(s.start, s.end, s.origin) for s in sent_spans([SentPart((5, 6, 7), p),
        ...                                                  SentPart((9, 9))])]
        [(0, 3, 0), (3, 5, None)]
    """
    spans: list[PartSpan] = []
    pos = 0
    for part in parts:
        end = pos + len(part.token_ids)
        if end > pos:
            piece = part.piece
            spans.append(PartSpan(pos, end, None if piece is None else piece.origin,
                                  "" if piece is None else piece.name, tuple(part.token_ids),
                                  () if piece is None else piece.behind,
                                  "" if piece is None else piece.key))
        pos = end
    return spans


def server_repair(repair: Repair, block_size: int) -> Repair:
    """``repair`` as a server with blocks of ``block_size`` runs it: regions aligned to the
    block size (an ``align`` of 1 becomes the block size; another must be a multiple of it).

    The share floor (``Repair.share``) is planned like the fixed count: each piece's region
    is ``max(first, ceil(share * len))`` tokens, then rounded up to the block. The adaptive
    rule (``Repair.adapt``) is refused: it decides each next chunk from the notes the last
    forward recomputed, and a server's phases are planned before the request runs; deciding
    there would mean reading the recomputed KV back from the server between phases.

    Example:
        >>> server_repair(Repair(first=32), 16).tag(), server_repair(Repair(share=0.1), 16).tag()
        ('f32a16', 'f32a16s0.1')
    """
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) \
            or block_size < 1:
        raise InvalidArgumentError(f"block_size must be a positive token count, got "
                                   f"{block_size!r}")
    if repair.budget:
        raise InvalidArgumentError(
            f"{repair.tag()}: a server repairs each piece's first tokens only; a shared budget "
            "(Repair.budget) needs the engine (Engine.compose). Use Repair(first=N).")
    if repair.adapt is not None:
        raise InvalidArgumentError(
            f"{repair.tag()}: the adaptive rule (Repair.adapt) needs the engine "
            "(Engine.compose): it sizes each region from the notes it recomputed, which a "
            "server's phases, planned before the request runs, never read back. Use the share "
            "floor: Repair(first=N, share=F).")
    if repair.align != 1 and repair.align % block_size:
        raise InvalidArgumentError(
            f"Repair(align={repair.align}) is not a multiple of the server's block size "
            f"{block_size}: a region must end on a block boundary to be a prefix-cache hit; "
            "leave align=1 (the block size is used)")
    return replace(repair, align=block_size if repair.align == 1 else repair.align)


@dataclass(frozen=True, slots=True)
class PhasePlan:
    """How one spliced, repaired request is sent: phases, then the real request.

    - ``ranges``: what the connector supplies (a :class:`~kvnotes.serving.protocol.SpliceRequest`
      in ``kv_transfer_params``);
    - ``regions``: the pieces' tokens vLLM computes in context instead (merged when adjacent);
    - ``phase_ends``: the end ``r`` of the recomputed region each phase caches, in order;
    - ``salt``: ``splice_salt(tenant, tag=repair.tag())``, shared by the phases and the real
      request (blocks of one repair plan never serve another);
    - ``keys``: the entry of each range, in order (the request's ``keys``: the connector
      supplies a range from that very entry or computes it); () when a span's entry is not
      known (the connector then picks by its own rule);
    - ``tenant``: whose entries the connector may use (None: the shared ones), sent with the
      ranges, so the connector never reads it back out of the salt.
    """

    prompt_len: int
    block_size: int
    repair: Repair
    salt: str
    ranges: tuple[SpliceRange, ...]
    regions: tuple[tuple[int, int], ...]
    phase_ends: tuple[int, ...]
    keys: tuple[str, ...] = ()
    tenant: str | None = None

    @property
    def spliced_tokens(self) -> int:
        """Tokens the connector supplies when every phase's blocks are still cached."""
        return sum(len(r) for r in self.ranges)

    @property
    def repaired_tokens(self) -> int:
        """Tokens of pieces vLLM computes in context."""
        return sum(b - a for a, b in self.regions)

    def ranges_before(self, end: int) -> tuple[SpliceRange, ...]:
        """The ranges that lie before token ``end`` (all of them inside ``[0, end)``)."""
        out = tuple(r for r in self.ranges if r.start < end)
        if out and out[-1].end > end:
            raise InvalidArgumentError(f"token {end} falls inside the splice range "
                                       f"{out[-1].to_list()}: cut a prompt between ranges")
        return out

    def splice_request(self, end: int | None = None) -> SpliceRequest:
        """What a request for the prompt's first ``end`` tokens (all of them by default) asks
        the connector (its ``kv_transfer_params`` are ``.to_params()``)."""
        ranges = self.ranges if end is None else self.ranges_before(end)
        return SpliceRequest(ranges, self.keys[:len(ranges)] if self.keys else (), self.tenant,
                             self.repair.tag())

    def phase_bodies(self, ids: Sequence[int], model: str) -> list[UpstreamBody]:
        """The ``/v1/completions`` bodies of the phases, to send one after the other (each one's
        blocks are the next one's local hit); their answers are discarded.

        The phase ending at ``r`` sends the prompt's first ``r + 1`` tokens with the ranges
        before ``r``: vLLM's local hit always leaves one prompt token to compute, so on a
        repeat the hit then covers the whole region and only token ``r`` is computed (its
        block is partly filled, never cached, and the real request supplies it from the
        piece).
        """
        ids = self._ids(ids)
        return [{"model": model, "prompt": ids[:r + 1], "max_tokens": 1, "temperature": 0.0,
                 "cache_salt": self.salt, "kv_transfer_params": self.splice_request(r).to_params()}
                for r in self.phase_ends]

    def real_body(self, ids: Sequence[int], model: str, *, max_tokens: int = 16,
                  guard: float | None = None, logprobs: int | None = None,
                  stream: bool = False) -> UpstreamBody:
        """The ``/v1/completions`` body of the real request (all ranges): greedy, with the
        first token's top-2 log-probs when ``guard`` is set (for :func:`guard_fires`)."""
        body = completion_body(self._ids(ids), model, max_tokens=max_tokens,
                               logprobs=_guard_logprobs(guard, logprobs), stream=stream)
        body["cache_salt"] = self.salt
        body["kv_transfer_params"] = self.splice_request().to_params()
        return body

    def wire(self, skills: Sequence[str] = (), entries: Sequence[PlanEntry] = (),
             exactly_placed: Sequence[str] = ()) -> WirePlan:
        """The plan as the client is told it (``usage.kvnotes.plan``): the one place a
        :class:`~kvnotes.serving.protocol.WirePlan` is made, with what the front matched."""
        return WirePlan(self.prompt_len, self.block_size, self.repair, self.salt, self.ranges,
                        self.regions, self.phase_ends, tuple(skills), tuple(entries),
                        tuple(exactly_placed))

    def _ids(self, ids: Sequence[int]) -> list[int]:
        if len(ids) != self.prompt_len:
            raise InvalidArgumentError(f"the plan is for a prompt of {self.prompt_len} tokens, "
                                       f"got {len(ids)}: plan the prompt that is sent")
        return [int(t) for t in ids]


def plan_phases(spans: Sequence[PartSpan], repair: Repair, block_size: int, *,
                tenant: str | None = None) -> PhasePlan:
    """The phases, ranges and salt of a prompt laid out as ``spans`` (contiguous from 0).

    The repair plan is :func:`~kvnotes.core.repair_plan.plan_repair`'s (the one
    ``Engine.compose`` executes): each piece not in the exact chain from token 0 (see the
    module docstring) is recomputed on ``[start, r)`` with ``r = repaired_end(start, end,
    first, block_size, share)`` (the share floor sized on the piece's length, then rounded up
    to the block) and supplied on ``[r, end)``. Ranges that follow one another
    without a gap form one group the connector supplies from a single local hit; a group
    that starts past token 0 needs a phase ending where it starts, and one that starts off a
    block boundary (a piece right after text with nothing recomputed, ``first=0``) can never
    be a local hit: it is left out, vLLM computes it (slower, never wrong).

    Example:
        >>> spans = [PartSpan(0, 40, 0), PartSpan(40, 140, 40), PartSpan(140, 240, 40),
        ...          PartSpan(240, 260)]
        >>> p = plan_phases(spans, Repair(first=32), 16)
        >>> [r.to_list() for r in p.ranges], p.regions, p.phase_ends, p.salt
        ([[0, 0, 40], [40, 40, 140], [140, 176, 240]], ((140, 176),), (176,), 'kvnotes-splice+f32a16')
    """
    repair = server_repair(repair, block_size)
    salt = splice_salt(tenant, tag=repair.tag())
    pos = 0
    for span in spans:
        if span.start != pos or span.end <= span.start:
            raise InvalidArgumentError(f"part spans must tile the prompt from token 0 without "
                                       f"gaps or empty parts; [{span.start}, {span.end}) follows "
                                       f"token {pos}")
        pos = span.end
    plan = plan_repair([layout_part(span) for span in spans], repair)
    by_index = plan.by_index()
    ranges: list[SpliceRange] = []
    key_of: dict[int, str] = {}  # a range's start -> its entry's key
    regions: list[tuple[int, int]] = []
    for i, span in enumerate(spans):
        if span.origin is None:
            continue
        piece = by_index.get(i)
        r = span.start if piece is None else piece.first_end  # exactly placed: spliced whole
        if piece is None and span.start % block_size and not (ranges and
                                                              ranges[-1].end == span.start):
            # an exactly placed piece right after text, off a block boundary: vLLM takes
            # external tokens only from a block-aligned local hit, so its tokens up to the next
            # boundary are computed in context (exact notes either way) and the rest supplied
            r = min(span.end, -(-span.start // block_size) * block_size)
        if r > span.start:
            if regions and regions[-1][1] == span.start:
                regions[-1] = (regions[-1][0], r)
            else:
                regions.append((span.start, r))
        if r < span.end:
            ranges.append(SpliceRange(span.start, r, span.end))
            key_of[r] = span.key
    kept: list[SpliceRange] = []
    ends: list[int] = []
    for group in _groups(ranges):
        g = group[0].start
        if g and g % block_size:
            continue
        if g:
            ends.append(g)
        kept += group
    keys = tuple(key_of[r.start] for r in kept)
    return PhasePlan(prompt_len=pos, block_size=int(block_size), repair=repair, salt=salt,
                     ranges=tuple(kept), regions=tuple(regions), phase_ends=tuple(ends),
                     keys=keys if all(keys) else (), tenant=tenant)


def layout_part(span: PartSpan) -> LayoutPart:
    """A part span as the repair plan sees it: text vLLM computes, or a registered piece. A
    piece whose entry records what it was prefilled behind (a variant) is exactly placed, as
    in ``Engine.compose``, when the prompt before it is those very ids at its origin (its
    prefix digest); one that does not is trusted at its origin behind a chain of pieces so
    placed from token 0 (``trust_chain``)."""
    if span.origin is None:
        return Text(len(span), span.ids)
    if not span.behind:
        return Piece(len(span), span.origin, span.ids, trust_chain=True)
    return Piece(len(span), span.origin, span.ids, prefix_len=len(span.behind),
                 prefix_digest=prefix_digest(span.behind), trust_chain=True)


def _groups(ranges: Sequence[SpliceRange]) -> list[list[SpliceRange]]:
    """Ranges in the groups the connector supplies from one hit (its ``range_run`` rule)."""
    groups: list[list[SpliceRange]] = []
    for r in ranges:
        if groups and r.start == groups[-1][-1].end and r.offset == 0:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def completion_body(ids: Sequence[int], model: str, *, max_tokens: int = 16,
                    logprobs: int | None = None, stream: bool = False) -> UpstreamBody:
    """A greedy ``/v1/completions`` body for token ids, with no salt: an exact request (the
    answer when the guard fires, or a request sent without splicing)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral) \
            or max_tokens < 1:
        raise InvalidArgumentError(f"max_tokens must be at least 1, got {max_tokens!r}")
    body: UpstreamBody = {"model": model, "prompt": [int(t) for t in ids],
                          "max_tokens": int(max_tokens), "temperature": 0.0}
    if logprobs is not None:
        body["logprobs"] = int(logprobs)
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def _guard_logprobs(guard: float | None, logprobs: int | None) -> int | None:
    if guard is None:
        return logprobs
    check_tau(guard)
    return max(GUARD_LOGPROBS, logprobs or 0)


def check_tau(tau: float) -> float:
    """``tau`` when it is a finite log-prob margin >= 0; InvalidArgumentError otherwise."""
    if isinstance(tau, bool) or not isinstance(tau, numbers.Real) or not math.isfinite(tau) \
            or tau < 0:
        raise InvalidArgumentError(f"guard tau is a log-prob margin >= 0 (0: never fires), got "
                                   f"{tau!r}")
    return float(tau)


def margin(top_logprobs: Mapping[str, float] | None) -> float | None:
    """Top-1 minus top-2 log-prob of one generated token's ``top_logprobs``; None with fewer
    than two entries.

    Example:
        >>> round(margin({"Yes": -0.1, "No": -2.5}), 6), margin({"Yes": -0.1})
        (2.4, None)
    """
    values = sorted((float(v) for v in (top_logprobs or {}).values()), reverse=True)
    return values[0] - values[1] if len(values) >= 2 else None


def guard_fires(top_logprobs: Mapping[str, float] | None, tau: float) -> bool:
    """True when the spliced answer's first token is too close a call to trust: its top-1 minus
    top-2 log-prob is below ``tau``. Fewer than two entries (none sent, or two tokens that
    decode to the same text and share a key) fire too: the margin is unknown.

    Example:
        >>> guard_fires({"Yes": -0.1, "No": -2.5}, 0.5), guard_fires({"Yes": -0.6, "No": -0.8}, 0.5)
        (False, True)
    """
    if check_tau(tau) == 0:
        return False
    m = margin(top_logprobs)
    return m is None or m < tau
