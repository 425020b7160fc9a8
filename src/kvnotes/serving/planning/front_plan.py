"""From one front request to the vLLM request bodies that splice it (phases, real, exact).

A text prompt is split at the registered skills it contains (:mod:`~kvnotes.serving.planning.match`)
and tokenized part by part as ``engine.compose`` lays a prompt out (BOS when the tokenizer adds
one, then each part alone: the layout of ``layout.prompt_ids``; the front lays it out when it
reads the request, :func:`~kvnotes.serving.planning.request.read_completion_text`, and sends
these ids spliced or not); a prompt of token ids is split where the pieces' tokens occur.
Either way the match says which piece each part is,
and the layout is built from it (matched once). The part layout is planned by
:func:`kvnotes.serving.planning.phases.plan_phases` (the repair rule, block-aligned, with the tenant's
salt), and the bodies come from the plan's builders with the client's sampling fields laid
over them. A chat comes laid out part by part (:mod:`~kvnotes.serving.planning.chat_render`):
each of its chunks (a tool, a content part) and each registered skill found in its text is
matched as a whole by its tokens at its position. A prompt with no registered skill or known
chunk, or whose pieces are all recomputed, raises
:class:`~kvnotes.serving.planning.request.Unplannable` (the request is forwarded as it came, or,
when the front sends it as its own ids, a structured chat or a completion text with a
registered skill, sent exactly as the same ids).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvnotes.core.repair import Repair
from kvnotes.core.variants import exactly_placed
from kvnotes.serving.json_types import UpstreamBody
from kvnotes.serving.library.splice import PieceIndex, PieceInfo
from kvnotes.serving.planning.chat_render import strip_bos_text
from kvnotes.serving.planning.layout import SentPart
from kvnotes.serving.planning.match import Part, SkillCatalog
from kvnotes.serving.planning.part_tokens import PartTokenCache
from kvnotes.serving.planning.phases import PartSpan, PhasePlan, completion_body, plan_phases, sent_spans
from kvnotes.serving.planning.request import FrontRequest, Unplannable
from kvnotes.serving.planning.spans import sweep
from kvnotes.serving.protocol import PlanEntry, WirePlan


def split_pieces(ids: Sequence[int], index: PieceIndex) -> list[SentPart]:
    """Token ids split where registered pieces occur (longest piece first at each token), each
    piece part with the piece :meth:`PieceIndex.match_at` found there. Only the positions
    where a piece may start are tried (:meth:`PieceIndex.starts`): the cost follows the
    prompt's length, not the number of pieces."""
    seq = tuple(int(t) for t in ids)

    def found() -> Iterator[tuple[int, int, PieceInfo]]:
        end = 0
        for at in index.starts(seq):
            piece = None if at < end else index.match_at(seq, at)
            if piece is not None:
                end = at + len(piece)
                yield at, end, piece

    return [SentPart(seq[a:b], piece) for a, b, piece in sweep(len(seq), found())]


def split_ids(ids: Sequence[int], index: PieceIndex) -> list[list[int]]:
    """Token ids split where registered pieces occur (:func:`split_pieces`'s parts' ids)."""
    return [list(p.token_ids) for p in split_pieces(ids, index)]


@dataclass(frozen=True, slots=True)
class FrontPlan:
    """A request's prompt as sent (``ids``), its layout, its phase plan, and its parts (each
    with the entry chosen for it: which variant of a skill was spliced, what
    :class:`~kvnotes.serving.planning.variant_demand.VariantHits` counts)."""

    ids: list[int]
    spans: list[PartSpan]
    plan: PhasePlan
    parts: tuple[SentPart, ...] = ()

    @property
    def skills(self) -> list[str]:
        return [s.name for s in self.spans if s.is_piece]

    def entries(self) -> list[PlanEntry]:
        """Per piece span: its name, the entry's key, its tokens and how many of them the plan
        recomputes in context (0: spliced as it is, e.g. an exactly placed variant)."""
        return [PlanEntry(s.name, s.key, s.start, s.end,
                          sum(max(0, min(b, s.end) - max(a, s.start))
                              for a, b in self.plan.regions))
                for s in self.spans if s.is_piece]

    @property
    def exactly_placed(self) -> list[str]:
        """The spliced skills whose entries sit behind the very ids they were compiled behind
        (nothing of them repaired: an exactly placed variant)."""
        out: list[str] = []
        pos = 0
        for part in self.parts:
            piece = part.piece
            if piece is not None and exactly_placed(piece.behind, piece.origin, self.ids, pos):
                out.append(piece.name)
            pos += len(part.token_ids)
        return out

    def wire(self) -> WirePlan:
        """The plan as the client is told it (``usage.kvnotes.plan``)."""
        return self.plan.wire(self.skills, self.entries(), self.exactly_placed)


__all__ = ["CatalogView", "FrontPlan", "catalog_view", "chat_parts", "exact_body",
           "plan_request", "real_body", "split_ids", "split_pieces", "strip_bos_text"]


@dataclass(frozen=True, slots=True)
class CatalogView:
    """What planning asks of the skill catalog: the registered texts in a text (``find``),
    a text prompt's found parts as sent (``lay_out``) and the pieces by tokens (``index``,
    read when planning, after the match)."""

    find: Callable[[str], list[Part]]
    lay_out: Callable[[Sequence[Part], Any], list[SentPart]]
    index: Callable[[], PieceIndex]


def catalog_view(catalog: SkillCatalog, tenant: str | None,
                 cache: PartTokenCache | None = None) -> CatalogView:
    """The catalog as one request's planning sees it (every call to the catalog goes through
    here: the one place a tenant's view is chosen). ``cache``: the text parts' ids kept by
    their text, for ``lay_out``."""
    return CatalogView(lambda text: catalog.find(text, tenant),
                       lambda found, tok: catalog.lay_out(found, tok, tenant, cache),
                       lambda: catalog.index(tenant))


def chat_parts(req: FrontRequest, index: PieceIndex) -> list[SentPart]:
    """A laid-out prompt's parts as sent (a chat's, or a completion text's): the BOS part,
    each registered skill and each chunk with the piece whose tokens are exactly its own at
    its position (None: computed)."""
    ids = req.prompt_ids
    out: list[SentPart] = []
    pos = len(req.lead_ids)
    if req.lead_ids:
        out.append(SentPart(req.lead_ids, index.match_exact(ids, 0, pos)))
    for part in req.parts:
        end = pos + len(part.token_ids)
        piece = None if part.kind == "text" else index.match_exact(ids, pos, end)
        out.append(SentPart(part.token_ids, piece))
        pos = end
    return out


def plan_request(req: FrontRequest, catalog: SkillCatalog, repair: Repair, block_size: int,
                 tenant: str | None, tokenizer: Any = None,
                 cache: PartTokenCache | None = None) -> FrontPlan:
    """The plan of ``req``'s prompt; :class:`Unplannable` when nothing would be spliced.
    ``tokenizer``: the catalog's, or a copy of it (one per planning thread); ``cache``: the
    text parts' ids kept by their text, for a text prompt not laid out yet."""
    tokenizer = catalog.tokenizer if tokenizer is None else tokenizer
    view = catalog_view(catalog, tenant, cache)
    if req.ids is not None:
        parts = split_pieces(req.ids, view.index())
    elif req.parts:
        parts = chat_parts(req, view.index())
    else:
        found = view.find(req.text or "")
        if not any(p.skill is not None for p in found):
            raise Unplannable("no registered skill in the prompt", "no_skill")
        parts = view.lay_out(found, tokenizer)
    spans = sent_spans(parts)
    if not any(s.is_piece and (s.start > 0 or len(s) > 1) for s in spans):  # BOS alone: no
        if req.chunks:
            raise Unplannable("no registered skill or known chunk in the prompt", "no_chunk")
        raise Unplannable("no registered skill in the prompt", "no_skill")
    plan = plan_phases(spans, repair, block_size, tenant=tenant)
    if not plan.ranges:
        raise Unplannable("nothing left to splice: every skill found is recomputed",
                          "nothing_left")
    return FrontPlan([t for p in parts for t in p.token_ids], spans, plan, tuple(parts))


def _client_body(body: UpstreamBody, req: FrontRequest) -> UpstreamBody:
    # the fields of the plan's bodies the client's own values replace (or remove, when it sent
    # none: vLLM's defaults then apply, as for a request sent to vLLM directly)
    body.pop("temperature", None)
    body.pop("max_tokens", None)
    out: UpstreamBody = {**body, **req.sampling}
    return out



def real_body(fp: FrontPlan, req: FrontRequest, model: str, tau: float) -> UpstreamBody:
    """The spliced request: all ranges, the client's sampling, the guard's log-probs."""
    body = fp.plan.real_body(fp.ids, model, guard=tau if tau > 0 else None,
                             logprobs=req.logprobs, stream=req.stream)
    return _client_body(body, req)


def exact_body(ids: Sequence[int], req: FrontRequest, model: str) -> UpstreamBody:
    """The same ids, no salt: the answer when the guard fires."""
    body = completion_body(ids, model, logprobs=req.logprobs, stream=req.stream)
    return _client_body(body, req)
