"""Where a measured request's prompt tokens went: spliced, repaired, aligned, or computed.

The front reports its phase plan in ``usage.kvnotes.plan`` (a
:class:`~kvnotes.serving.protocol.WirePlan`: the ranges the connector supplied, the repair
policy's fields, the regions recomputed); the benchmark lays the
same chat out as the front does (:func:`~kvnotes.serving.planning.chat_render.render_chat_parts`
then :func:`~kvnotes.serving.planning.chat_render.lay_out_chat`: the chunks' token spans). Put
together, every prompt token falls in exactly one bucket of :class:`ShareBreakdown`:

- ``spliced``: supplied from a learned entry (a chunk's tail, or BOS);
- ``repaired``: a matched chunk's first ``max(first, ceil(share * len))`` tokens, recomputed
  in context by the repair rule (capped at the chunk);
- ``aligned``: a matched chunk's tokens recomputed past its repair so the region ends on a KV
  block boundary (a phase's cache hit is whole blocks only);
- ``unmatched``: chunks no learned entry matched (not learned yet, too short to learn, or
  dropped from the plan);
- ``text``: what is never a chunk: the template, the system turn, the question, the separators
  between tools (the header before the first chunk is ``text_head`` of it).

Pure: nothing here talks to a server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvnotes.core.repair import first_tokens
from kvnotes.serving.protocol import ProtocolError, WirePlan, repair_to_dict
from kvnotes_bench.kit.records import Record
from kvnotes_bench.serving.agent_traffic_client import Answer
from kvnotes_bench.serving.agent_traffic_requests import AgentRequest

BUCKETS = ("spliced", "repaired", "aligned", "unmatched", "text")


@dataclass(frozen=True)
class ShareBreakdown(Record):
    """One answer's prompt tokens by bucket (see the module docstring); the buckets add up to
    ``prompt``. ``chunks``: the request's chunks as the front lays them out, ``matched`` of them
    planned from a learned entry, ``spliced_chunks`` of those with a spliced tail. ``layout_ok``:
    the benchmark's layout has the server's prompt length (else only ``spliced`` is the
    server's own figure)."""

    prompt: int
    spliced: int
    repaired: int
    aligned: int
    unmatched: int
    text: int
    text_head: int
    chunks: int
    matched: int
    spliced_chunks: int
    chunk_tokens: int
    repair: dict[str, Any] | None  # the plan's repair policy (its fields; None: no plan)
    layout_ok: bool

    def share(self, bucket: str) -> float | None:
        return getattr(self, bucket) / self.prompt if self.prompt else None


def chunk_spans(request: AgentRequest, tokenizer: Any) -> tuple[int, list[tuple[int, int]]]:
    """``(prompt tokens, [(start, end) of each chunk])`` of ``request`` as the front lays it
    out (its own rendering and part-wise tokenization)."""
    from kvnotes.serving.planning.chat_render import lay_out_chat, render_chat_parts

    laid = lay_out_chat(tokenizer, render_chat_parts(tokenizer, request.messages(),
                                                     request.tools()).parts)
    pos = len(laid.lead_ids)
    spans = []
    for part in laid.parts:
        end = pos + len(part.token_ids)
        if part.is_chunk and end > pos:
            spans.append((pos, end))
        pos = end
    return pos, spans


def breakdown(plan: WirePlan | None, prompt_len: int,
              spans: Sequence[tuple[int, int]], prompt_tokens: int | None = None
              ) -> ShareBreakdown:
    """The buckets of one answer: ``plan`` is its ``usage.kvnotes.plan`` (None: nothing
    spliced), ``prompt_len`` and ``spans`` the layout's (:func:`chunk_spans`),
    ``prompt_tokens`` the server's count (checks the layout).

    Example:
        >>> from kvnotes.serving.library.splice import SpliceRange
        >>> from kvnotes.core.repair import Repair
        >>> plan = WirePlan(120, 64, Repair(first=32, align=64), "s", (SpliceRange(0, 0, 1),
        ...                 SpliceRange(10, 64, 100)), (), ())
        >>> b = breakdown(plan, 120, [(10, 100), (101, 110)], 120)
        >>> b.spliced, b.repaired, b.aligned, b.unmatched, b.text, b.text_head
        (37, 32, 22, 9, 20, 9)
    """
    first, share = (0, 0.0) if plan is None else (plan.repair.first, plan.repair.share)
    ranges = [] if plan is None else [(r.piece_start, r.start, r.end) for r in plan.ranges]
    regions = [] if plan is None else list(plan.regions)
    by_start = {r[0]: r for r in ranges}
    spliced = sum(e - s for _, s, e in ranges)
    repaired = aligned = unmatched = matched = spliced_chunks = 0
    for start, end in spans:
        n = end - start
        rng = by_start.get(start)
        if rng is not None:
            computed = rng[1] - start
            spliced_chunks += 1
        elif any(a <= start < b for a, b in regions):
            computed = n  # the repair region covers the whole chunk
        else:
            unmatched += n
            continue
        matched += 1
        fixed = min(n, computed, first_tokens(n, first, share)) if computed else 0
        repaired += fixed
        aligned += computed - fixed
    chunk_tokens = sum(e - s for s, e in spans)
    spliced_outside = sum(e - s for _, s, e in ranges if s not in {a for a, _ in spans}
                          and not any(a <= s < b for a, b in spans))
    text = prompt_len - chunk_tokens - spliced_outside
    return ShareBreakdown(
        prompt=prompt_len, spliced=spliced, repaired=repaired, aligned=aligned,
        unmatched=unmatched, text=text,
        text_head=spans[0][0] - sum(min(e, spans[0][0]) - s for _, s, e in ranges
                                    if s < spans[0][0]) if spans else text,
        chunks=len(spans), matched=matched, spliced_chunks=spliced_chunks,
        chunk_tokens=chunk_tokens, repair=None if plan is None else repair_to_dict(plan.repair),
        layout_ok=prompt_tokens is None or prompt_tokens == prompt_len)


def answer_breakdown(answer: Answer, layout: tuple[int, Sequence[tuple[int, int]]]
                     ) -> ShareBreakdown | None:
    """:func:`breakdown` of one answer against its request's layout (:func:`chunk_spans`);
    None for a failed answer or one whose ``usage.kvnotes`` this version does not read."""
    if not answer.ok:
        return None
    try:
        usage = answer.usage()
    except ProtocolError:
        return None
    return breakdown(None if usage is None else usage.plan, layout[0], layout[1],
                     answer.prompt_tokens)


@dataclass(frozen=True)
class PooledBreakdown(Record):
    """The buckets of many answers pooled (each bucket's tokens over all prompt tokens), and
    the mean number of chunks, matched and spliced per request."""

    requests: int
    prompt: int
    shares: dict[str, float]
    chunks_mean: float
    matched_mean: float
    spliced_chunks_mean: float
    layout_ok: int


def pool(parts: Sequence[ShareBreakdown]) -> PooledBreakdown | None:
    """``parts`` pooled (None when there are none)."""
    if not parts:
        return None
    prompt = sum(b.prompt for b in parts)
    n = len(parts)
    return PooledBreakdown(
        requests=n, prompt=prompt,
        shares={k: (sum(getattr(b, k) for b in parts) / prompt if prompt else 0.0)
                for k in (*BUCKETS, "text_head")},
        chunks_mean=sum(b.chunks for b in parts) / n,
        matched_mean=sum(b.matched for b in parts) / n,
        spliced_chunks_mean=sum(b.spliced_chunks for b in parts) / n,
        layout_ok=sum(b.layout_ok for b in parts))
