"""Compile and compose: skills prefilled once, spliced into prompts, their boundaries repaired.

Functions over a :class:`~kvnotes.core.runner.ModelRunner` (the engine's ``compile``,
``compose``, ``recompute``, ``repair_choice`` and ``note_deviation`` delegate here).
:func:`compose` lays its parts out as a :mod:`~kvnotes.core.repair_plan` layout, asks
:func:`~kvnotes.core.repair_plan.plan_repair` which spliced notes to recompute and executes
that plan (:func:`execute_piece_repair`, which the agent's turn builder runs too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

import kvnotes.core.validate as validate
from kvnotes.core.document import Document
from kvnotes.core.errors import EmptyInputError, InvalidArgumentError, KvnotesError, UnknownNameError
from kvnotes.core.notebook import Notebook, Span
from kvnotes.core.repair import (
    DEFAULT_REPAIR,
    Repair,
    adapt_end,
    as_repair,
    prefix_digest,
    relative_change,
    repair_selector,
)
from kvnotes.core.repair_plan import Part as LayoutPart
from kvnotes.core.repair_plan import Piece, PieceRepair, RepairPlan, Text, plan_repair
from kvnotes.core.runner import ModelRunner
from kvnotes.core.variants import VariantSource

Part = str | Document | Notebook
# a part read: a compiled notebook to splice, or text's ids and spans to prefill
_Piece = Notebook | tuple[list[int], list[Span]]

ANCHORS = ("auto", "bos", "none")


def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted indices as maximal contiguous ``[start, end)`` runs."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def anchor_ids(engine: ModelRunner, after: str | Sequence[int] | torch.Tensor | None = None, *,
               anchor: str = "auto") -> list[int]:
    """The token ids a skill is compiled behind (their notes are then dropped).

    ``anchor`` decides the BOS: ``"bos"`` puts one first, ``"none"`` does not, ``"auto"``
    does when the tokenizer adds BOS by default (as every context then starts with one).
    ``after`` is what follows it in the contexts the skill is meant for: text (encoded on
    its own, as compose encodes each part) or token ids, which are taken as given, BOS
    included (``anchor`` must then stay ``"auto"``).
    """
    if anchor not in ANCHORS:
        raise UnknownNameError("anchor", anchor, ANCHORS)
    if after is not None and not isinstance(after, str):
        if anchor != "auto":
            raise InvalidArgumentError(
                "anchor applies to text; token ids in after= are taken as given, so put "
                "the BOS id first yourself or pass the prefix as text")
        ids = [int(i) for i in (after.reshape(-1).tolist() if isinstance(after, torch.Tensor)
                                else after)]
        validate.token_ids(ids, "after", validate.vocab_size(engine))
        return ids
    if after is not None:
        validate.text(after, "after")
    if anchor == "auto":
        anchor = "bos" if engine.adds_bos else "none"
    prefix: list[int] = []
    if anchor == "bos":
        bos = engine.bos_id if engine.bos_id is not None else engine.tokenizer.bos_token_id
        if bos is None:
            raise KvnotesError("anchor='bos' needs a tokenizer with a BOS token; use "
                               "anchor='none'")
        prefix.append(int(bos))
    return prefix + (engine.encode(after) if after else [])


def compile_skill(engine: ModelRunner, text: str, *, name: str = "skill",
            after: str | Sequence[int] | torch.Tensor | None = None,
            anchor: str = "auto") -> Notebook:
    """Compile a skill: ``text`` prefilled once, ready to be spliced anywhere.

    It is prefilled behind :func:`anchor_ids` ``(after, anchor=anchor)``, whose notes are then
    dropped: it keeps its true positions and notes written attending to that prefix, as in a
    context that starts with it (alone at 0, its first token would become an attention sink the
    real context never has; the default prefix is the context's own start, a BOS when the
    tokenizer adds one). ``meta`` keeps the prefix (``prefix_len``, ``prefix_digest``,
    ``prefix_ids``): :func:`compose` splices a skill placed right after it as it is.

    Example:
        >>> skill = engine.compile(policy, after=system_header)    # doctest: +SKIP
    """
    return compile_skills(engine, [text], names=[name], after=after, anchor=anchor)[0]


def compile_skills(engine: ModelRunner, texts: Sequence[str], *,
                   names: Sequence[str] | None = None,
                   after: str | Sequence[int] | torch.Tensor | None = None,
                   anchor: str = "auto") -> list[Notebook]:
    """Skills compiled as one prompt shows them: one prefill of ``after`` and every text, each
    skill keeping its notes there, behind everything before it (its ``prefix_digest`` covers it
    all). :func:`compose` of ``[after, *skills, ...]`` in this order then reuses every note
    unrepaired (a prefill's, as a prefix cache serves them); in another order or context they
    are repaired like any splice.

    Example:
        >>> tools = engine.compile_skills([tool_a, tool_b], after=header)  # doctest: +SKIP
    """
    validate.not_bare_string(texts, "compile_skills texts", "engine.compile_skills([text])")
    validate.not_bare_string(names, "compile_skills names", "names=[name]")
    if not texts:
        raise EmptyInputError("compile_skills needs at least one text")
    names = list(names) if names is not None else [f"skill{i}" for i in range(len(texts))]
    if len(names) != len(texts):
        raise InvalidArgumentError(f"compile_skills: {len(texts)} texts but {len(names)} names")
    for text, name in zip(texts, names, strict=True):
        validate.compile_args(text, name)
    prefix = anchor_ids(engine, after, anchor=anchor)
    parts = [engine.tokens_of(text, bos=False)[0] for text in texts]
    whole = engine.forward(engine.empty(0), [*prefix, *(t for ids in parts for t in ids)]).notebook
    bos = "bos" if prefix[:1] == [engine.bos_id] and engine.bos_id is not None else "none"
    out, before = [], list(prefix)
    for ids, name in zip(parts, names, strict=True):
        nb = whole.slice(len(before), len(before) + len(ids))
        out.append(nb.with_spans([Span(name, "skill", 0, len(ids))]).with_meta(
            kind="skill", name=name, anchor=bos, after_tokens=len(before) - (bos == "bos"),
            prefix_len=len(before), prefix_digest=prefix_digest(before),
            prefix_ids=[int(t) for t in before]))
        before += ids
    return out


def recompute(engine: ModelRunner, nb: Notebook, indices: Sequence[int] | torch.Tensor) -> Notebook:
    """``nb`` with the notes of the tokens at ``indices`` recomputed in context.

    Indices are taken in order, as maximal runs of consecutive ones; each run is fed (one
    forward) on top of every note before it, recomputed or kept, at its own positions, and
    its notes replace the old ones. Notes not chosen are kept as they are, so recomputing
    every index equals a prefill of ``nb``'s tokens (up to float error). This is the one
    selective-recompute step: compose's boundary repair and the ``repair`` edit strategy
    both use it. ``nb`` is never changed.
    """
    idx = sorted({int(i) for i in (indices.reshape(-1).tolist()
                                   if isinstance(indices, torch.Tensor) else indices)})
    if idx and not (0 <= idx[0] and idx[-1] < len(nb)):
        bad = [i for i in idx if not 0 <= i < len(nb)]
        raise InvalidArgumentError(
            f"recompute indices must be token indices in [0, {len(nb)}) of a notebook of "
            f"{len(nb)} tokens; got {len(bad)} out of range ({bad[0]}"
            f"{f'..{bad[-1]}' if len(bad) > 1 else ''})")
    if not idx:
        return nb
    nb.check_same_model(engine.fingerprint, what="recompute notes of")
    return _recompute_runs(engine, nb, idx, in_place=False)


def _recompute_runs(engine: ModelRunner, nb: Notebook, idx: list[int], *, in_place: bool) -> Notebook:
    """:func:`recompute` of sorted indices; ``in_place`` for a notebook whose storage only
    the caller views (compose's own), else the first run writes into a copy."""
    logits = None
    for a, b in _runs(idx):
        ids = nb.token_ids[a:b].tolist()
        position_ids = engine.adapter.position_ids(nb.positions[a:b].clone())
        # the forward writes rows [a, b) again, attending to the notes before a
        nb, out = nb.rewritten(a, b, engine.feeder(ids, position_ids), in_place=in_place)
        in_place = True  # later runs write into the copy the first one made
        logits = out.logits[0, -1].float() if b == len(nb) else None
    return nb.with_logits(logits)


def repair_choice(engine: ModelRunner, nb: Notebook, at: int, k: int, *, select: str = "first",
                  layer: int = 1) -> tuple[list[int], float]:
    """Which ``k`` of the notes spliced at ``nb[at:]`` a boundary repair recomputes, in
    order, and what choosing them cost in token-equivalents: ``"first"`` takes the first
    ``k`` (free); ``"kv_deviation"`` the ``k`` whose ``layer`` notes deviate most from a
    recompute's (:func:`note_deviation`, a partial forward over the spliced tokens)."""
    repair_selector(select, "compose")
    if not 0 <= at <= len(nb) or not 0 <= k <= len(nb) - at:
        raise InvalidArgumentError(f"repair_choice needs 0 <= at <= {len(nb)} and 0 <= k <= "
                                   f"the {len(nb) - at} notes after at; got at={at}, k={k}")
    if not k:
        return [], 0.0
    if select == "kv_deviation":
        scores = note_deviation(engine, nb, at, layer)  # [len(nb) - at]
        chosen = sorted((torch.topk(scores, k).indices + at).tolist())
        return chosen, (len(nb) - at) * (layer + 1) / engine.adapter.num_layers
    return list(range(at, at + k)), 0.0


def note_deviation(engine: ModelRunner, nb: Notebook, start: int, layer: int = 1) -> torch.Tensor:
    """FloatTensor[len(nb) - start]: how far each note of ``nb`` from ``start`` on is, at
    ``layer``, from the note a recompute of those tokens on top of ``nb[:start]`` writes
    (summed norms of the key and value differences), as CacheBlend selects tokens.

    The forward stops once ``layer`` has written its notes, so it costs ``(layer + 1) /
    num_layers`` of a recompute of ``len(nb) - start`` tokens.
    """
    if not 1 <= layer < engine.adapter.num_layers:
        raise InvalidArgumentError(
            f"deviation layer must be in 1..{engine.adapter.num_layers - 1} (layer 0's notes "
            f"depend on the token alone), got {layer}")
    new = engine.layer_notes(nb.slice(0, start), nb.token_ids[start:].tolist(), layer)
    dk = (new.keys - nb.keys(layer)[..., start:, :]).float().norm(dim=-1).sum(dim=(0, 1))
    dv = (new.values - nb.values(layer)[..., start:, :]).float().norm(dim=-1).sum(dim=(0, 1))
    return (dk + dv).cpu()


def compose(engine: ModelRunner, parts: Sequence[Part], *, start: int = 0,
            repair: Repair | float | int = DEFAULT_REPAIR, layer: int = 1,
            library: VariantSource | None = None, variants: bool = True) -> Notebook:
    """One contiguous notebook from text, documents and compiled skills, in order.

    Text and documents are prefilled in place (attending to everything before them);
    skills are re-rotated to their new positions and spliced. When the tokenizer adds BOS,
    the notebook starts with one.

    ``repair`` (a :class:`~kvnotes.core.repair.Repair`, or what
    :func:`~kvnotes.core.repair.as_repair` reads: an int ``K`` the first ``K`` tokens of each
    spliced skill, a float in (0, 1] that fraction of the spliced tokens, 0 the bare splice)
    says which spliced notes are recomputed in context, right after each splice, so later
    parts attend to repaired notes; :func:`~kvnotes.core.repair_plan.plan_repair` is the rule.
    By default (:data:`~kvnotes.core.repair.DEFAULT_REPAIR`) each spliced skill's first
    ``max(32, ceil(0.1 * len))`` tokens are recomputed (the share floor, ``Repair.share``),
    each region ending at :func:`~kvnotes.core.repair.repaired_end` (on a multiple of
    ``repair.align``): a tool description of ~200 tokens gets its first 32, a 3k-token API
    manual its first 300, where a fixed 32 flipped the choice (measured figures:
    docs/results/areas/tools.md, "Repair that sizes itself").
    ``repair.adapt`` grows each region while its last recomputed tokens' notes moved by more
    than that threshold (:func:`execute_adaptive_repair`; ``meta["compose"]["adapt"]`` counts
    its extra tokens and forwards). A skill placed at the very position it was compiled at, right
    after the very prefix it was compiled behind (``meta["prefix_digest"]``), with every note
    before it exact (text, or skills so placed), already holds a prefill's notes and is not
    repaired (``repair.skip_exact``): e.g. a header compiled alone, then a skill compiled
    ``after=`` it. A skill whose positions are not consecutive (image tokens of an M-RoPE
    prefill) is spliced as it is: its token ids alone cannot recompute it.

    ``repair.budget`` recomputes further tokens on top of that, among those not yet
    repaired (exact placements excluded): a float in (0, 1] is a fraction of them (rounded
    up), an int a token count; it is shared among the skills in proportion to those tokens,
    and ``repair.select`` picks them: ``"first"`` the tokens that follow each repaired
    region, ``"kv_deviation"`` those whose notes at ``layer`` deviate most from a recompute
    (CacheBlend's choice; the selection pass costs ``(layer + 1) / num_layers`` of
    recomputing the rest of the skill). Every spliced token repaired (``repair=1.0``, or
    ``Repair(first=n)`` with ``n`` at least each skill's length) equals a full prefill up
    to float error; ``repair=0`` splices only.

    ``library`` (a :class:`~kvnotes.SkillLibrary`, or any
    :class:`~kvnotes.core.variants.VariantSource`): each compiled skill is swapped for the
    library's variant of it that ranks first where it is placed
    (:func:`~kvnotes.core.variants.variant_rank`: the one compiled behind the prompt's own ids
    before it, e.g. behind the header and the skill that precedes it, stored by
    ``library.get(text, after=...)``; that one is exactly placed when its whole prefix is the
    prompt's, and not repaired), else the skill given is kept (e.g. the header-anchored one,
    repaired). ``variants=False`` keeps every skill as given.

    ``nb.meta["compose"]`` counts tokens ``reused`` (spliced and kept), ``computed``
    (text prefilled), ``repaired`` (spliced, then recomputed) and ``select_tokens`` (the
    selection pass in token-equivalents), gives ``compute_fraction`` (what was run through
    the model as a fraction of a full prefill), ``regions`` (the ``[start, end)`` token
    ranges recomputed as skills' first tokens), ``exact`` (the indices of the parts
    spliced as they are because exactly placed), ``select`` and ``repair`` (the Repair's
    :meth:`~kvnotes.core.repair.Repair.tag`); with the adaptive rule, ``adapt`` (``planned``:
    the tokens the plan's regions held, ``extra_tokens`` and ``extra_forwards`` the rule
    added, ``changes``: the relative change measured after each forward, per repaired skill);
    when a ``library`` is given, ``variants`` (the indices of the parts a variant of it
    replaced).
    """
    validate.compose_args(engine, parts, start)
    if not parts:
        raise EmptyInputError("compose needs at least one part")
    plan = as_repair(repair)  # a Repair checks itself: a bad one fails before any model work
    pieces = _read_parts(engine, parts)
    bos = [] if engine.bos_id is None else [engine.bos_id]
    swapped = (_swap_variants(pieces, library, bos, start) if library is not None and variants
               else [])
    layout: list[LayoutPart] = [Text(1, tuple(bos))] if bos else []
    layout += [layout_part(p) for p in pieces]
    todo = plan_repair(layout, plan, start=start)
    # one allocation of the final size: no buffer grows (and copies) while composing
    nb = engine.empty(start, capacity=sum(p.length for p in layout))
    nb, tally = _splice_and_repair(engine, nb, bos, pieces, todo, start=start, layer=layer)
    stats = _compose_stats(todo, tally, len(nb), len(bos),
                           swapped if library is not None else None)
    return nb.with_meta(compose=stats)


def _read_parts(engine: ModelRunner, parts: Sequence[Part]) -> list[_Piece]:
    """Each part as a piece: a notebook checked to splice here, or text and documents
    tokenized on their own (a document's non-field spans named after the part)."""
    pieces: list[_Piece] = []
    for i, part in enumerate(parts):
        if isinstance(part, Notebook):
            part.check_same_model(engine.fingerprint, what="splice a skill into")
            if not len(part):
                raise EmptyInputError(f"part {i} is an empty notebook")
            pieces.append(part)
        elif isinstance(part, (str, Document)):
            ids, spans = engine.tokens_of(part, bos=False, name=f"part{i}")
            if isinstance(part, Document):
                spans = [s if s.kind == "field" else Span(f"part{i}.{s.name}", s.kind, s.start,
                                                         s.end) for s in spans]
            pieces.append((ids, spans))
        else:
            raise TypeError(f"compose parts are str, Document or Notebook, got {type(part)}")
    return pieces


@dataclass(slots=True)
class _Tally:
    """What composing ran, by kind: tokens ``reused`` (spliced and kept), ``computed`` (text
    prefilled), ``select_tokens`` (selection passes, in token-equivalents) and, with the
    adaptive rule, what it did to each repaired part (``grown``, by layout index)."""

    reused: int = 0
    computed: int = 0
    select_tokens: float = 0.0
    grown: dict[int, AdaptiveRepair] = field(default_factory=dict)


def _splice_and_repair(engine: ModelRunner, nb: Notebook, bos: list[int],
                       pieces: Sequence[_Piece], todo: RepairPlan, *, start: int,
                       layer: int) -> tuple[Notebook, _Tally]:
    """``nb`` (compose's empty notebook) with ``bos`` and then every piece written in order:
    text prefilled, skills spliced and, where ``todo`` plans it, repaired right after their
    splice (so later parts attend to repaired notes); and the tally of what that ran."""
    plan, by_index, tally = todo.repair, todo.by_index(), _Tally()
    if bos:
        nb = engine.forward(nb, bos, spans=[Span("bos", "text", 0, 1)]).notebook
        tally.computed += 1
    for i, piece in enumerate(pieces, start=len(bos)):
        if not isinstance(piece, Notebook):
            nb = engine.forward(nb, piece[0], spans=piece[1]).notebook
            tally.computed += len(piece[0])
            continue
        nb = nb.splice(piece)  # re-rotated straight into nb's storage
        todo_piece = by_index.get(i)
        if todo_piece is None:  # exactly placed (its notes are a prefill's), or not from ids
            tally.reused += len(piece)
            continue
        if plan.adapt is not None:
            nb, tally.grown[i] = execute_adaptive_repair(engine, nb, todo_piece, plan,
                                                         start=start, in_place=True)
            tally.reused += len(piece) - tally.grown[i].piece.repaired
            continue
        nb, cost = execute_piece_repair(engine, nb, todo_piece, select=plan.select, layer=layer,
                                        in_place=True)  # nb's storage is compose's own
        tally.select_tokens += cost
        tally.reused += len(piece) - todo_piece.repaired
    return nb, tally


def _compose_stats(todo: RepairPlan, tally: _Tally, length: int, n_bos: int,
                   swapped: list[int] | None) -> dict[str, object]:
    """``nb.meta["compose"]`` (the keys :func:`compose` lists) for a notebook of ``length``
    tokens composed by ``todo`` with ``n_bos`` BOS tokens first; ``swapped``: the parts a
    library's variant replaced, None when no library was given."""
    plan, grown = todo.repair, tally.grown
    done = [grown[p.index].piece if p.index in grown else p for p in todo.pieces]
    repaired = sum(p.repaired for p in done)
    fraction = (tally.computed + repaired + tally.select_tokens) / max(1, length)
    stats: dict[str, object] = {
        "reused": tally.reused, "computed": tally.computed, "repaired": repaired,
        "select": plan.select, "select_tokens": tally.select_tokens,
        "compute_fraction": fraction,
        "regions": [list(p.region) for p in done if p.first_end > p.start],
        "exact": [i - n_bos for i in todo.exact], "repair": plan.tag(),
        **({"variants": swapped} if swapped is not None else {})}
    if plan.adapt is not None:
        stats["adapt"] = {"planned": todo.repaired,
                          "extra_tokens": repaired - todo.repaired,
                          "extra_forwards": sum(g.forwards - 1 for g in grown.values()),
                          "changes": [list(g.changes) for g in grown.values()]}
    return stats


def _swap_variants(pieces: list[_Piece], library: VariantSource, bos: list[int],
                   start: int) -> list[int]:
    """Replace, in place, each skill of ``pieces`` by ``library``'s variant that ranks first
    behind the ids before it; the indices of the parts replaced."""
    ids = list(bos)
    swapped = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, Notebook):
            found = library.variant(piece, ids, start + len(ids))
            if found is not None:
                found.check_same_model(piece.fingerprint, what="splice a variant of")
                if found.token_ids.tolist() != piece.token_ids.tolist():
                    raise InvalidArgumentError(f"the library's variant of part {i} holds other "
                                               "tokens than the skill it replaces")
                pieces[i] = piece = found
                swapped.append(i)
            ids += piece.token_ids.tolist()
        else:
            ids += piece[0]
    return swapped


def layout_part(piece: _Piece) -> LayoutPart:
    """One compose part as a layout part: text (its ids) or a spliced notebook (its ids, its
    origin, whether its positions are consecutive, and the prefix compile recorded)."""
    if not isinstance(piece, Notebook):
        return Text(len(piece[0]), tuple(piece[0]))
    origin = piece.start_position
    consecutive = torch.equal(piece.positions.cpu(), torch.arange(origin, origin + len(piece)))
    meta = piece.meta
    prefix_len, digest = meta.get("prefix_len"), meta.get("prefix_digest")
    # no recorded prefix (a notebook not from compile): never an exact placement
    return Piece(len(piece), origin, tuple(piece.token_ids.tolist()), consecutive,
                 prefix_len if isinstance(prefix_len, int) else None,
                 digest if isinstance(digest, str) else None)


@dataclass(frozen=True, slots=True)
class AdaptiveRepair:
    """What the adaptive rule did to one piece: ``piece`` with its region as executed (grown
    from the plan's), the ``forwards`` run on it (1: the plan's region only) and the relative
    change measured after each (:func:`~kvnotes.core.repair.relative_change`)."""

    piece: PieceRepair
    forwards: int
    changes: tuple[float, ...]


def _spliced_rows(nb: Notebook, a: int, b: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A copy of the notes of tokens ``[a, b)``, every layer (what a recompute overwrites)."""
    return [(nb.keys(l)[..., a:b, :].clone(), nb.values(l)[..., a:b, :].clone())
            for l in range(nb.num_layers)]


def _change(nb: Notebook, old: list[tuple[torch.Tensor, torch.Tensor]], a: int) -> float:
    """The relative L2 change of the notes of ``nb`` from token ``a`` on against ``old`` (their
    spliced copy), keys and values of every layer together."""
    sums = []
    for l, (k, v) in enumerate(old):
        n = k.shape[-2]
        nk, nv = nb.keys(l)[..., a:a + n, :].float(), nb.values(l)[..., a:a + n, :].float()
        k, v = k.float(), v.float()
        sums.append((float((nk - k).pow(2).sum() + (nv - v).pow(2).sum()),
                     float(k.pow(2).sum() + v.pow(2).sum())))
    return relative_change(sums)


def execute_adaptive_repair(engine: ModelRunner, nb: Notebook, piece: PieceRepair,
                            repair: Repair, *, start: int = 0, in_place: bool = False
                            ) -> tuple[Notebook, AdaptiveRepair]:
    """``nb`` (whose notes ``[piece.start, piece.end)`` were just spliced) with ``piece``'s
    region recomputed, then grown by ``repair.adapt_step`` tokens at a time while the last
    recomputed tokens' notes moved by more than ``repair.adapt`` (relative L2 of keys and
    values, every layer, against their spliced copy), up to
    :func:`~kvnotes.core.repair.adapt_end` (``start``: the layout's first position, for
    alignment). Each step is one forward on top of the repaired notes before it, so the
    region is always a run from the piece's first token: its notes are a prefill's whenever
    everything before the piece is.
    """
    if repair.adapt is None:
        raise InvalidArgumentError("execute_adaptive_repair needs a Repair with adapt set")
    if len(nb) != piece.end:
        raise InvalidArgumentError(f"the plan repairs tokens [{piece.start}, {piece.end}) of a "
                                   f"notebook of {len(nb)}: repair a piece right after its "
                                   "splice")
    cap = adapt_end(start + piece.start, start + piece.end, repair) - start
    a, r = piece.start, piece.first_end
    if r <= a:
        return nb, AdaptiveRepair(piece, 0, ())
    w = max(a, r - repair.adapt_step)  # the last tokens of the region are the measurement
    old = _spliced_rows(nb, w, r)
    nb = _recompute_runs(engine, nb, list(range(a, r)), in_place=in_place)
    forwards, changes = 1, [_change(nb, old, w)]
    while r < cap and changes[-1] > repair.adapt:
        nxt = start + r + repair.adapt_step
        nxt = min(cap, -(-nxt // repair.align) * repair.align - start)
        old = _spliced_rows(nb, r, nxt)
        nb = _recompute_runs(engine, nb, list(range(r, nxt)), in_place=True)
        forwards += 1
        changes.append(_change(nb, old, r))
        r = nxt
    grown = PieceRepair(piece.index, piece.start, piece.end, r)
    return nb, AdaptiveRepair(grown, forwards, tuple(changes))


def execute_piece_repair(engine: ModelRunner, nb: Notebook, piece: PieceRepair, *, select: str,
                         layer: int = 1, in_place: bool = False) -> tuple[Notebook, float]:
    """``nb`` (whose notes ``[piece.start, piece.end)`` were just spliced) with ``piece``'s
    planned repair done: its first tokens' region, then its budget's tokens chosen by
    ``select`` (:func:`repair_choice`); and what the choice cost in token-equivalents.
    ``in_place``: ``nb``'s storage is the caller's own (compose's), else the first recompute
    writes into a copy.

    With ``"first"`` the region and the budget's tokens are one run, recomputed in one pass.
    Another selector reads the notes after the region on top of the repaired region (the
    deviation of a note is measured against a recompute behind the notes before it), so the
    region is recomputed first and the chosen tokens in a second pass: the choice cannot be
    made before the first pass has written the notes it reads.
    """
    if len(nb) != piece.end:
        raise InvalidArgumentError(f"the plan repairs tokens [{piece.start}, {piece.end}) of a "
                                   f"notebook of {len(nb)}: repair a piece right after its "
                                   "splice")
    first = list(range(piece.start, piece.first_end))
    if first and select != "first" and piece.budget:
        nb = _recompute_runs(engine, nb, first, in_place=in_place)
        in_place, first = True, []
    chosen, cost = repair_choice(engine, nb, piece.first_end, piece.budget, select=select,
                                 layer=layer)
    if first or chosen:
        nb = _recompute_runs(engine, nb, first + chosen, in_place=in_place)
    return nb, cost
