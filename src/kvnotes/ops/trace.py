"""Notes tracing: causal KV patching that shows where a field-conditioned decision lives.

Two prefills of the same document, one with the field's *old* value and one with its *new*
value (equal token length, so the notebooks line up token for token), give two notebooks. A
*hybrid* notebook takes some (layer, token) sites from one and the rest from the other; the
query is then fed on top of the hybrid (always recomputed, so it reads whatever the hybrid
holds) and the metric is read at the **decision position**, the query's last token:

    m = logit[first token of new_answer] - logit[first token of old_answer]

(first tokens only; the two answers must differ in their first token). With ``m_old`` and
``m_new`` the metric of the unpatched old and new runs and ``d = m_new - m_old``:

- **denoising** (new into old): ``effect = (m_patched - m_old) / d``. How much of the decision
  the patched sites *carry* on their own: 0 = still the old run, 1 = fully the new run.
- **noising** (old into new): ``effect = (m_new - m_patched) / d``. How much of the decision is
  *lost* when the sites are reverted: 0 = still the new run, 1 = fully the old run.
  Noising sites S equals denoising every other site, so ``noising(S) = 1 - denoising(not S)``.

Sites: the field's own KV (the overwrite an in-place edit does), the *notes* (every token after
the field, all layers), both at once (the full patch = the new run), each layer's field KV and
each layer's notes, each downstream position's notes (all layers), and optionally a
layer x position grid. Tokens before the field are identical in both runs (causal attention)
and are never patched.

A normalized effect is only meaningful when the field moves the decision: every result carries
its denominator ``d`` and ``sensitive = |d| >= min_denominator`` (docs/design.md: about one logit);
:func:`summarize` keeps insensitive cases out of the aggregates and counts them.

One generic patch loop (:func:`splice`, :func:`patch_metrics`) with thin named analyses over
it, in the TransformerLens manner; the case-suite runner lives in :mod:`kvnotes.research.trace.suite`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvnotes.core import validate
from kvnotes.core.document import Document
from kvnotes.core.errors import KvnotesError, TraceLengthError
from kvnotes.core.metrics import normalized_effect
from kvnotes.core.notebook import LayerKV, Notebook
from kvnotes.core.records import Json
from kvnotes.ops.decisions import first_token_ids

if TYPE_CHECKING:
    from kvnotes.core.engine import Engine

DIRECTIONS = ("denoising", "noising")
Metric = Callable[[torch.Tensor], float]


@dataclass(frozen=True, slots=True)
class TraceOptions:
    """What :func:`trace` measures beyond the headline field/notes effects.

    Args:
        directions: ``"denoising"`` (new into old) and/or ``"noising"`` (old into new).
        by_layer: per-layer field and notes effects (2 runs per layer and direction).
        position_bins: ``None`` traces every downstream token's notes separately (one run per
            token and direction); an int groups the downstream tokens into that many contiguous
            bins instead (cheaper, comparable across documents of different lengths).
        grid_bins: columns of the layer x position grid after the field column (0 = no grid).
        grid_layer_groups: rows of the grid (``None`` = one row per layer).
        min_denominator: ``|m_new - m_old|`` below this marks the case insensitive.
        detail_when_insensitive: when False, an insensitive case gets only its headline
            effects (field, notes, full): its ratios are noise anyway and runs are saved.
        batch_size: hybrids fed per forward (memory grows with it; results do not change).
    """

    directions: tuple[str, ...] = DIRECTIONS
    by_layer: bool = True
    position_bins: int | None = None
    grid_bins: int = 0
    grid_layer_groups: int | None = None
    min_denominator: float = 1.0
    detail_when_insensitive: bool = True
    batch_size: int = 16

    def __post_init__(self) -> None:
        bad = [d for d in self.directions if d not in DIRECTIONS]
        if bad or not self.directions:
            raise ValueError(f"directions must be a non-empty subset of {DIRECTIONS}, got "
                             f"{self.directions!r}")
        if self.position_bins is not None and self.position_bins < 1:
            raise ValueError("position_bins must be None or at least 1")
        if self.grid_bins < 0 or (self.grid_layer_groups is not None and self.grid_layer_groups < 1):
            raise ValueError("grid_bins must be >= 0 and grid_layer_groups None or >= 1")


@dataclass(frozen=True, slots=True)
class DirectionEffects:
    """Normalized effects of one patching direction (see the module docstring for the sign).

    ``field_by_layer[l]`` / ``notes_by_layer[l]``: layer ``l`` only. ``notes_by_position[i]``:
    the notes of ``TraceResult.positions[i]`` in every layer. ``grid[r][c]``: layer group ``r``
    (``TraceResult.grid_layers``) at column ``c`` (0 = field, then the notes bins of
    ``TraceResult.grid_positions``). Empty lists where not measured.
    """

    field: float
    notes: float
    full: float
    field_by_layer: list[float] = dataclasses.field(default_factory=list)
    notes_by_layer: list[float] = dataclasses.field(default_factory=list)
    notes_by_position: list[float] = dataclasses.field(default_factory=list)
    grid: list[list[float]] = dataclasses.field(default_factory=list)


@dataclass(frozen=True, slots=True)
class TraceResult:
    """Where one field-conditioned decision lives: field KV vs downstream notes.

    ``field_effect`` and ``notes_effect`` are the denoising effects (docs/design.md, Metrics):
    new field KV in the old notebook (an in-place overwrite), and new notes with the old field.
    Every effect shares the denominator ``m_new - m_old`` reported here.
    """

    field_name: str
    old_value: str
    new_value: str
    answers: tuple[str, str]  # (new_answer, old_answer)
    answer_ids: tuple[int, int]
    m_old: float
    m_new: float
    sensitive: bool
    field_span: tuple[int, int]  # token indices [start, end) in the notebook
    n_tokens: int  # notebook length (the query is not part of it)
    positions: list[tuple[int, int]]  # token ranges of notes_by_position, downstream of the field
    grid_layers: list[tuple[int, int]]  # layer ranges [start, end) of the grid rows
    grid_positions: list[tuple[int, int]]  # token ranges of grid columns 1.. (column 0 = field)
    denoising: DirectionEffects | None
    noising: DirectionEffects | None
    top_old: str  # the old run's top-1 next token at the decision position
    top_new: str
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def denominator(self) -> float:
        """``m_new - m_old``: how far the field moves the decision, in logits."""
        return self.m_new - self.m_old

    @property
    def flips(self) -> bool:
        """Whether the preferred answer (sign of m) differs between the old and new runs."""
        return (self.m_old > 0) != (self.m_new > 0)

    @property
    def field_effect(self) -> float:
        """Denoising effect of the field's own KV alone (new field in the old notebook)."""
        return self._main().field

    @property
    def notes_effect(self) -> float:
        """Denoising effect of the notes alone (new downstream KV, old field KV)."""
        return self._main().notes

    def _main(self) -> DirectionEffects:
        if self.denoising is None:
            raise KvnotesError("field_effect/notes_effect are denoising effects; this trace ran "
                               "only the noising direction (use result.noising)")
        return self.denoising

    def to_dict(self) -> Json:
        """Plain JSON-ready data (NaN becomes None)."""
        data = asdict(self)
        data.update(denominator=self.denominator, flips=self.flips,
                    field_effect=self.denoising.field if self.denoising else None,
                    notes_effect=self.denoising.notes if self.denoising else None)
        out: Json = _finite(data)
        return out

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)


# ---- the generic patch loop -----------------------------------------------------------------
def splice(base: Notebook, source: Notebook, sites: torch.Tensor) -> Notebook:
    """A hybrid notebook: ``source``'s KV at ``sites``, ``base``'s everywhere else.

    ``sites`` is a BoolTensor[num_layers, n] over (layer, token). Both notebooks must come from
    the same model and line up token for token (same length and positions). Returns a new
    notebook with ``base``'s token ids, spans and positions.
    """
    _check_aligned(base, source)
    assert sites.shape == (len(base.layers), len(base)), "sites must be [num_layers, n]"
    layers = []
    for l, (b, s) in enumerate(zip(base.layers, source.layers, strict=True)):
        row = sites[l]
        if not row.any():
            layers.append(b)
        elif row.all():
            layers.append(s)
        else:
            pick = row.view(1, 1, -1, 1).to(b.keys.device)
            layers.append(LayerKV(torch.where(pick, s.keys, b.keys),
                                  torch.where(pick, s.values, b.values)))
    return base.with_layers(layers)


@torch.inference_mode()
def patch_metrics(engine: Engine, base: Notebook, source: Notebook,
                  site_sets: Sequence[torch.Tensor], query: Sequence[int], metric: Metric,
                  *, batch_size: int = 16) -> list[float]:
    """The one patch loop: ``metric`` after ``query`` on each hybrid, ``batch_size`` per forward.

    Each hybrid is ``splice(base, source, sites)``; hybrids are fed the query together through
    :meth:`Engine.forward_batch` (equal to :meth:`Engine.next_logits` up to float error).
    """
    _check_aligned(base, source)
    base.check_same_model(engine.fingerprint, what="trace")
    out: list[float] = []
    for i in range(0, len(site_sets), batch_size):
        hybrids = [splice(base, source, s) for s in site_sets[i:i + batch_size]]
        logits = engine.forward_batch(hybrids, list(query))  # [b, vocab]
        out.extend(metric(row) for row in logits)
    return out


def _check_aligned(base: Notebook, source: Notebook) -> None:
    base.check_same_model(source.fingerprint, what="splice KV across")
    if len(base) != len(source) or not torch.equal(base.positions, source.positions):
        raise KvnotesError("splice needs two notebooks of equal length and positions")


def logit_difference(answer_ids: tuple[int, int]) -> Metric:
    """``logits[a] - logits[b]`` for ``answer_ids = (a, b)``."""
    a, b = answer_ids
    return lambda logits: float(logits[a] - logits[b])


# ---- site sets --------------------------------------------------------------------------------
def _sites(num_layers: int, n: int, tokens: tuple[int, int],
           layers: tuple[int, int] | None = None) -> torch.Tensor:
    sites = torch.zeros(num_layers, n, dtype=torch.bool)
    lo, hi = layers if layers is not None else (0, num_layers)
    sites[lo:hi, tokens[0]:tokens[1]] = True
    return sites


def _bins(start: int, end: int, k: int | None) -> list[tuple[int, int]]:
    """``[start, end)`` as single tokens (k None) or k contiguous near-equal bins."""
    if k is None:
        return [(i, i + 1) for i in range(start, end)]
    k = min(k, end - start)
    edges = [start + round(i * (end - start) / k) for i in range(k + 1)] if k else [start]
    return [(edges[i], edges[i + 1]) for i in range(k)]


# ---- the named analysis -------------------------------------------------------------------------
def trace(engine: Engine, doc: Document, *, field: str, new_value: str,
          query: str | Sequence[int], answers: tuple[str | int, str | int],
          options: TraceOptions | None = None) -> TraceResult:
    """Trace where the field-conditioned decision lives: the field's own KV or the notes after it.

    Args:
        engine: the model.
        doc: the document with the field at its *old* value.
        field: the field's name; ``new_value`` its new value (same number of tokens as the old).
        query: text or ids fed after the document; the decision position is its last token.
        answers: ``(new_answer, old_answer)``, as text (its first token is used: with a leading
            space unless the query text ends in whitespace) or as token ids.
        options: what to measure beyond the headline effects (:class:`TraceOptions`).

    Returns:
        A :class:`TraceResult`; ``result.field_effect`` and ``result.notes_effect`` are the
        denoising effects, with the denominator ``result.denominator`` alongside.

    Raises:
        TraceLengthError: the old and new values tokenize to different lengths.
        EmptyAnswerError, AnswerTokenError: an empty answer, or answers sharing their first
            token (:mod:`kvnotes.core.errors`); KvnotesError: an empty query.

    Example:
        >>> doc = kvnotes.Document(["Status: ", kvnotes.Field("status", "pending"), ".\\n"])
        >>> r = kvnotes.trace(engine, doc, field="status", new_value="closed",  # one token each
        ...                   query="Refundable? Answer:", answers=("no", "yes"))
        >>> r.denominator == r.m_new - r.m_old, r.sensitive == (abs(r.denominator) >= 1.0)
        (True, True)
    """
    validate.trace_args(engine, doc, field, new_value, query, answers, (options or TraceOptions()).batch_size)
    opts = options or TraceOptions()
    old_value = doc.value(field)
    new_doc = doc.with_value(field, new_value)
    old_ids, old_spans = engine.tokens_of(doc)
    new_ids, new_spans = engine.tokens_of(new_doc)
    check_equal_length(engine, field, old_value, new_value, old_ids, new_ids)
    query_ids = query_tokens(engine, query)
    answer_ids = answer_token_ids(engine, query, answers)

    old_nb = engine.prefill(doc)
    new_nb = engine.prefill(new_doc)
    span = old_nb.span(field)
    L, n = len(old_nb.layers), len(old_nb)
    metric = logit_difference(answer_ids)
    old_logits = engine.next_logits(old_nb, query_ids)
    new_logits = engine.next_logits(new_nb, query_ids)
    m_old, m_new = metric(old_logits), metric(new_logits)
    sensitive = abs(m_new - m_old) >= opts.min_denominator
    detail = sensitive or opts.detail_when_insensitive

    sites = _site_plan(L, n, (span.start, span.end), opts, detail=detail)
    effects: dict[str, DirectionEffects | None] = {d: None for d in DIRECTIONS}
    for direction in opts.directions:
        effects[direction] = _direction_effects(
            engine, direction, old_nb, new_nb, sites, query_ids, metric, m_old, m_new,
            batch_size=opts.batch_size)
    return TraceResult(
        field_name=field, old_value=old_value, new_value=new_value,
        answers=(str(answers[0]), str(answers[1])), answer_ids=answer_ids,
        m_old=m_old, m_new=m_new, sensitive=sensitive,
        field_span=(span.start, span.end), n_tokens=n, positions=sites.positions,
        grid_layers=sites.grid_layers, grid_positions=sites.grid_positions,
        denoising=effects["denoising"], noising=effects["noising"],
        top_old=engine.decode([int(old_logits.argmax())]),
        top_new=engine.decode([int(new_logits.argmax())]),
    )


@dataclass(frozen=True, slots=True)
class _SitePlan:
    """The site sets one trace patches, by effect (in the order they run), and the ranges its
    per-position effects and grid cover (as :class:`TraceResult` reports them)."""

    groups: dict[str, list[torch.Tensor]]
    positions: list[tuple[int, int]]
    grid_layers: list[tuple[int, int]]
    grid_positions: list[tuple[int, int]]


def _site_plan(L: int, n: int, field_tokens: tuple[int, int], opts: TraceOptions, *,
               detail: bool) -> _SitePlan:
    """Every site set ``opts`` asks for over ``L`` layers and ``n`` tokens, the field at tokens
    ``field_tokens`` (``[start, end)``); without ``detail`` only the headline ones (field,
    notes, full)."""
    notes_tokens = (field_tokens[1], n)
    positions = _bins(field_tokens[1], n, opts.position_bins) if detail else []
    grid = detail and opts.grid_bins > 0
    grid_layers = _bins(0, L, opts.grid_layer_groups) if grid else []
    grid_positions = _bins(field_tokens[1], n, opts.grid_bins) if grid else []
    by_layer = detail and opts.by_layer
    groups: dict[str, list[torch.Tensor]] = {
        "field": [_sites(L, n, field_tokens)],
        "notes": [_sites(L, n, notes_tokens)],
        "full": [torch.ones(L, n, dtype=torch.bool)],
        "field_by_layer": [_sites(L, n, field_tokens, (l, l + 1)) for l in range(L)]
        if by_layer else [],
        "notes_by_layer": [_sites(L, n, notes_tokens, (l, l + 1)) for l in range(L)]
        if by_layer else [],
        "notes_by_position": [_sites(L, n, p) for p in positions],
        "grid": [_sites(L, n, cols, rows) for rows in grid_layers
                 for cols in [field_tokens, *grid_positions]],
    }
    return _SitePlan(groups, positions, grid_layers, grid_positions)


def _direction_effects(engine: Engine, direction: str, old_nb: Notebook, new_nb: Notebook,
                       sites: _SitePlan, query_ids: Sequence[int], metric: Metric,
                       m_old: float, m_new: float, *, batch_size: int) -> DirectionEffects:
    """The normalized effect of every site set of ``sites`` patched in ``direction``
    (denoising: new into old; noising: old into new), all hybrids in one patch loop."""
    base, source = (old_nb, new_nb) if direction == "denoising" else (new_nb, old_nb)
    flat = [s for group in sites.groups.values() for s in group]
    ms = iter(patch_metrics(engine, base, source, flat, query_ids, metric,
                            batch_size=batch_size))
    sign = 1.0 if direction == "denoising" else -1.0
    offset = 0.0 if direction == "denoising" else 1.0
    values = {k: [offset + sign * normalized_effect(next(ms), m_old, m_new) for _ in group]
              for k, group in sites.groups.items()}
    cols = len(sites.grid_positions) + 1
    return DirectionEffects(
        field=values["field"][0], notes=values["notes"][0], full=values["full"][0],
        field_by_layer=values["field_by_layer"], notes_by_layer=values["notes_by_layer"],
        notes_by_position=values["notes_by_position"],
        grid=[values["grid"][r * cols:(r + 1) * cols] for r in range(len(sites.grid_layers))],
    )


# ---- inputs -------------------------------------------------------------------------------------
def check_equal_length(engine: Engine, field: str, old_value: str, new_value: str,
                       old_ids: Sequence[int], new_ids: Sequence[int]) -> None:
    """Raise :class:`TraceLengthError` unless old and new documents line up token for token."""
    a, b = len(engine.encode(old_value)), len(engine.encode(new_value))
    if a != b or len(old_ids) != len(new_ids):
        raise TraceLengthError(
            f"trace needs old and new values of equal token length, but field {field!r} is "
            f"{a} token(s) as {old_value!r} and {b} as {new_value!r} with this tokenizer. "
            "Patching swaps KV site by site, so the old and new notebooks must line up token "
            "for token; pick a new value with the same number of tokens."
        )


def query_tokens(engine: Engine, query: str | Sequence[int]) -> list[int]:
    """Token ids of the query (never with BOS); refuses an empty query."""
    ids = engine.encode(query) if isinstance(query, str) else [int(i) for i in query]
    if not ids:
        raise KvnotesError("trace needs a non-empty query: its last token is the decision position")
    return ids


def answer_token_ids(engine: Engine, query: str | Sequence[int],
                     answers: tuple[str | int, str | int]) -> tuple[int, int]:
    """The first token of ``(new_answer, old_answer)`` right after ``query``, by
    :func:`kvnotes.ops.decisions.first_token_ids` (its space rule; ints are token ids)."""
    if len(answers) != 2:
        raise KvnotesError(f"answers must be (new_answer, old_answer), got {answers!r}")
    after = query if isinstance(query, str) else engine.decode(query)
    new, old = first_token_ids(engine, answers, after=after)
    return new, old


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
