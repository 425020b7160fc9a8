"""The Engine: one model, its tokenizer and its position adapter, and the verbs over notebooks.

Reads like a small inference stack: :meth:`Engine.forward` feeds tokens on top of a notebook and
returns the longer notebook plus the last logits (the model call itself is :meth:`Engine._call`;
the notebook's own :meth:`~kvnotes.core.notebook.Notebook.append` takes the new notes into its
storage); everything else (prefill, extend, compile, compose, next_logits, greedy) is a few lines
over it, and :meth:`Engine.continue_greedy` is the one decode loop. Editing fields is
:func:`kvnotes.edit` in the ops layer, above the engine.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from kvnotes.core import validate
from kvnotes.core.attention import use_grouped_sdpa
from kvnotes.core.cache import NotebookCache, build_cache, build_padded_cache
from kvnotes.core.document import Document, added_bos, document_meta, encode
from kvnotes.core.errors import (
    ArgumentTypeError,
    EmptyInputError,
    InvalidArgumentError,
    KvnotesError,
    PositionError,
    UnknownNameError,
)
from kvnotes.core.fingerprint import ModelFingerprint
from kvnotes.core.notebook import SPAN_KINDS, LayerKV, Notebook, Span
from kvnotes.core.positions import adapter_for
from kvnotes.core.positions.base import text_config
from kvnotes.core.repair import DEFAULT_REPAIR, Repair, as_repair, repaired_end
from kvnotes.core.storage import Claim
from kvnotes.core.work import CausalLM, CostModel, WorkCounter

TokenInput = str | Sequence[int] | torch.Tensor | Document
Part = str | Document | Notebook


ANCHORS = ("auto", "bos", "none")


@dataclass(frozen=True, slots=True)
class RepairSelector:
    """A way to choose which notes a repair recomputes, and the operations that take it:
    ``"edit"`` (the ``repair`` strategy of :func:`kvnotes.edit`) and ``"compose"`` (boundary
    repair in :meth:`Engine.compose`)."""

    name: str
    operations: tuple[str, ...]
    summary: str


# the one vocabulary of repair selectors (edit strategies and compose repair)
REPAIR_SELECTORS: dict[str, RepairSelector] = {s.name: s for s in (
    RepairSelector("first", ("compose",), "the first tokens of each spliced skill (free)"),
    RepairSelector("attention", ("edit",),
                   "the tokens after the field that attend to it most at prefill"),
    RepairSelector("kv_deviation", ("edit", "compose"),
                   "the tokens whose notes at an early layer deviate most from a recompute "
                   "(CacheBlend's choice)"),
)}
REPAIR_OPERATIONS = ("edit", "compose")


def selectors_for(operation: str) -> tuple[str, ...]:
    """The repair selectors ``operation`` (``"edit"`` or ``"compose"``) takes, in order."""
    if operation not in REPAIR_OPERATIONS:
        raise UnknownNameError("repair operation", operation, REPAIR_OPERATIONS)
    return tuple(n for n, s in REPAIR_SELECTORS.items() if operation in s.operations)


def repair_selector(name: object, operation: str, where: str = "") -> str:
    """``name`` checked as a repair selector of ``operation``; the error lists the selectors
    ``operation`` takes and says which of the others serve only another operation.

    Example:
        >>> repair_selector("kv_deviation", "compose")
        'kv_deviation'
        >>> repair_selector("first", "edit")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        kvnotes.core.errors.UnknownNameError: unknown repair selector 'first'; ... compose only)
    """
    valid = selectors_for(operation)
    if isinstance(name, str) and name in valid:
        return name
    others = "; ".join(f"{n} applies to {' and '.join(s.operations)} only"
                       for n, s in REPAIR_SELECTORS.items() if n not in valid)
    raise UnknownNameError("repair selector", name, valid,
                           "; ".join(h for h in (others, where) if h))


def repair_budget(repair: object, spliced: int) -> int:
    """How many of ``spliced`` tokens a ``repair=`` budget recomputes.

    A float in [0, 1] is a fraction of them, rounded up (any positive fraction repairs at least
    one); an int >= 0 is a token count, capped at ``spliced``. ``1.0`` is all, ``1`` is one.
    """
    if isinstance(repair, bool) or not isinstance(repair, numbers.Real):
        raise ArgumentTypeError(
            f"repair must be a fraction of the spliced tokens (a float in (0, 1]) or a token "
            f"count (an int), got {repair!r} ({type(repair).__name__})")
    if isinstance(repair, numbers.Integral):
        if repair < 0:
            raise InvalidArgumentError(f"repair={repair} is a negative token count; give a count "
                                       ">= 0 (0 splices only) or a fraction in (0, 1]")
        return min(int(repair), spliced)
    fraction = float(repair)
    if not 0.0 <= fraction <= 1.0:  # nan fails too
        raise InvalidArgumentError(
            f"repair={repair!r} is not a fraction in (0, 1]; give e.g. repair=0.05 to recompute "
            "5% of the spliced tokens, or an int token count such as repair=16")
    return min(spliced, math.ceil(fraction * spliced - 1e-9))


def split_budget(k: int, sizes: Sequence[int]) -> list[int]:
    """``k`` tokens shared among parts of ``sizes`` in proportion to their size (largest
    remainders get the rest), never more than a part has."""
    total = sum(sizes)
    if not total or not k:
        return [0] * len(sizes)
    exact = [k * s / total for s in sizes]
    out = [min(s, int(e)) for s, e in zip(sizes, exact, strict=True)]
    order = sorted(range(len(sizes)), key=lambda i: out[i] - exact[i])
    for i in order:
        if sum(out) >= k:
            break
        if out[i] < sizes[i]:
            out[i] += 1
    return out


def prefix_digest(ids: Sequence[int]) -> str:
    """A short digest of token ids: what :meth:`Engine.compile` records of the prefix a skill
    was compiled behind (``meta["prefix_digest"]``), so compose can tell a skill placed right
    after that very prefix without keeping the prefix's ids.

    Example:
        >>> prefix_digest([1, 2, 3]) == prefix_digest([1, 2, 3]) != prefix_digest([1, 2])
        True
    """
    return hashlib.sha256(",".join(str(int(i)) for i in ids).encode()).hexdigest()[:16]


def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted indices as maximal contiguous ``[start, end)`` runs."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


@dataclass(frozen=True, slots=True)
class Generation:
    """A greedy continuation: its text, its token ids and the notebook that now holds them."""

    text: str
    token_ids: list[int]
    notebook: Notebook
    first_logits: torch.Tensor  # FloatTensor[vocab] at the first generated position


@dataclass(frozen=True, slots=True)
class Continuation:
    """One row of :meth:`Engine.greedy_batch`: a :class:`Generation` without its notebook (the
    rows' generated notes live in one batch cache that is dropped)."""

    text: str
    token_ids: list[int]
    first_logits: torch.Tensor  # FloatTensor[vocab] at the first generated position


@dataclass(frozen=True, slots=True)
class Step:
    """One forward: the longer notebook, the last fed token's logits and the raw model output."""

    notebook: Notebook
    logits: torch.Tensor  # FloatTensor[vocab] after the last fed token
    output: Any  # the model's output (``.attentions`` when asked for)


class Engine:
    """A transformers causal LM wrapped for notebook work.

    Example:
        >>> engine = kvnotes.load("smollm2-135m")                     # doctest: +SKIP
        >>> nb = engine.prefill("The capital of France is")           # doctest: +SKIP
        >>> engine.generate(nb, "", max_new_tokens=3)                  # doctest: +SKIP
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, name: str | None = None) -> None:
        model.eval()
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # grouped K/V attended without transformers' per-forward repeat_kv copy (CPU only)
        self.grouped_attention = use_grouped_sdpa(model, self.device)
        self.tokenizer = tokenizer
        self.name = name or str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
        self.adapter = adapter_for(model)
        self.fingerprint = ModelFingerprint.of(model, tokenizer)
        # BOS rule: a notebook starts with BOS exactly when tokenizer(text) would add one.
        self.bos_id: int | None = added_bos(tokenizer)
        self.eos_ids: set[int] = _eos_ids(model, tokenizer)
        self.keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        # what every model call costs, counted in _call (benchmarks read it around their work);
        # a forward that layer_notes stops early is counted whole
        self.cost = CostModel.of(cast(CausalLM, model), _blocks_or_none(model))
        self.work = WorkCounter()

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer: Any, *, name: str | None = None) -> Engine:
        """Wrap any already-loaded transformers causal LM (tiny random ones too)."""
        return cls(model, tokenizer, name=name)

    def __repr__(self) -> str:
        return f"Engine({self.name!r}, scheme={self.adapter.name!r}, layers={self.adapter.num_layers})"

    # ---- tokens ---------------------------------------------------------------------------
    @property
    def adds_bos(self) -> bool:
        return self.bos_id is not None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without any special token."""
        return encode(self.tokenizer, text)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        return self.tokenizer.decode(list(map(int, ids)), skip_special_tokens=True)

    def tokens_of(self, x: TokenInput, *, bos: bool | None = None, name: str = "text",
                  kind: str = "text") -> tuple[list[int], list[Span]]:
        """Ids and spans for any input; ``bos=None`` adds BOS to text/documents per the BOS rule."""
        if isinstance(x, Document):
            ids, raw = x.tokenize(self.tokenizer)
            spans = [Span(n, k if k == "field" else kind, s, e) for n, k, s, e in raw]
            is_text = True
        elif isinstance(x, str):
            ids = self.encode(x)
            spans = [Span(name, kind, 0, len(ids))] if ids else []
            is_text = True
        else:
            ids = [int(i) for i in (x.reshape(-1).tolist() if isinstance(x, torch.Tensor) else x)]
            spans = [Span(name, kind, 0, len(ids))] if ids else []
            is_text = False
        if not ids:
            raise EmptyInputError(f"empty input: {x!r} has no tokens")
        if (self.adds_bos if bos is None else bos) and (is_text or bos):
            if self.bos_id is None:
                raise KvnotesError("this tokenizer has no BOS token to add")
            ids = [self.bos_id, *ids]
            spans = [Span("bos", "text", 0, 1), *(s.moved(1) for s in spans)]
        return ids, spans

    # ---- the one forward ------------------------------------------------------------------
    def empty(self, start: int = 0, *, capacity: int = 0) -> Notebook:
        """A notebook with no tokens whose first token will sit at ``start``.

        ``capacity``: room for that many tokens before its storage has to grow.
        """
        self.adapter.check_positions(torch.tensor([start]))
        return Notebook.empty(self.adapter, self.fingerprint, origin=start, capacity=capacity)

    def _feeder(self, ids: list[int], position_ids: torch.Tensor, **call_kwargs: Any
                ) -> Callable[[Claim], Any]:
        """A writer for :meth:`Notebook.append` / :meth:`Notebook.rewritten`: one forward of
        ``ids`` whose notes go into the claimed rows; returns the model's output."""
        def feed(claim: Claim) -> Any:
            return self._call(NotebookCache(claim), [ids], position_ids, **call_kwargs)
        return feed

    def forward(self, nb: Notebook, ids: Sequence[int] | torch.Tensor, *,
                spans: Sequence[Span] = (), positions: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, attentions: bool = False,
                **model_kwargs: Any) -> Step:
        """The one forward: feed ``ids`` on top of ``nb`` -> the longer notebook and the logits.

        Args:
            nb: the notes the new tokens attend to (never changed).
            ids: token ids to feed; ``spans`` name ranges of them (indices relative to ``ids``).
            positions: LongTensor[q], the bookkeeping position of each new token (default: the
                next ``q`` positions after ``nb``).
            position_ids: what the model's forward takes as ``position_ids`` when it is not
                ``adapter.position_ids(positions)`` (M-RoPE's three axes per token, [3, 1, q]).
            attentions: also return attention weights (``step.output.attentions``); runs the
                model with eager attention for this call.
            model_kwargs: more inputs for the model (``pixel_values``, ...).

        Raises:
            NotebookMismatchError: ``nb`` was written by another model.
            PositionError: a position is negative, before ``nb``'s end or past the maximum.
        """
        ids = [int(i) for i in (ids.reshape(-1).tolist() if isinstance(ids, torch.Tensor) else ids)]
        if not ids:
            raise EmptyInputError("forward needs at least one token")
        nb.check_same_model(self.fingerprint, what="extend a notebook with")
        if positions is None:
            positions = torch.arange(nb.next_position, nb.next_position + len(ids))  # [q]
        positions = positions.to(torch.long).reshape(-1)
        if positions.numel() != len(ids):
            raise ValueError(f"{positions.numel()} positions for {len(ids)} tokens")
        self.adapter.check_positions(positions)
        if len(nb) and int(positions.min()) < nb.next_position:
            raise PositionError(f"new tokens at position {int(positions.min())} would sit before "
                                f"the notebook's end ({nb.next_position}); feed them after it")
        if position_ids is None:
            position_ids = self.adapter.position_ids(positions)
        else:
            self.adapter.check_positions(position_ids.reshape(-1))
        # in place when nb ends at its storage's fill point (Notebook.append decides)
        longer, out = nb.append(ids, positions, self._feeder(ids, position_ids,
                                                             attentions=attentions,
                                                             **model_kwargs), spans=spans)
        logits = out.logits[0, -1].float()
        return Step(longer.with_logits(logits), logits, out)

    def probe(self, nb: Notebook, ids: Sequence[int], *, every_position: bool = True
              ) -> torch.Tensor:
        """FloatTensor[q, vocab]: the logits after each of ``ids`` fed on top of ``nb``
        (``every_position=False``: after the last one only, FloatTensor[1, vocab]).

        Nothing is kept: the storage the forward wrote is given back, so ``nb`` can still be
        extended in place (a query read, an option scored).
        """
        ids = [int(i) for i in ids]
        if not ids:
            raise EmptyInputError("probe needs at least one token")
        nb.check_same_model(self.fingerprint, what="extend a notebook with")
        positions = torch.arange(nb.next_position, nb.next_position + len(ids))  # [q]
        self.adapter.check_positions(positions)
        feed = self._feeder(ids, self.adapter.position_ids(positions), all_logits=every_position)
        _, out = nb.append(ids, positions, feed, keep=False)  # the rows are given back
        return out.logits[0].float()

    def forward_batch(self, notebooks: Sequence[Notebook], ids: Sequence[int]) -> torch.Tensor:
        """FloatTensor[b, vocab]: the logits after ``ids`` on top of each notebook, in one forward.

        The notebooks may differ in length and positions (they are left-padded and the pads
        masked, see :func:`~kvnotes.core.cache.build_padded_cache`); each row equals
        :meth:`forward` on that notebook up to float error.
        """
        if not notebooks:
            raise EmptyInputError("forward_batch needs at least one notebook")
        ids = [int(i) for i in ids]
        if not ids:
            raise EmptyInputError("forward_batch needs at least one token")
        starts = self._batch_starts(notebooks)
        cache, pads = build_padded_cache(notebooks)
        width = len(notebooks[0]) + pads[0]
        padded: dict[str, Any] = (  # unpadded: the model's own causal mask is enough
            {"attention_mask": self._padding_mask(pads, width + len(ids)).to(self.device)}
            if any(pads) else {})
        out = self._call(cache, [ids] * len(notebooks), self._batch_positions(starts, len(ids)),
                         **padded)
        return out.logits[:, -1].float()  # [b, vocab]

    def greedy_batch(self, notebooks: Sequence[Notebook], query: TokenInput | None,
                     max_new_tokens: int = 32, *, stop: Sequence[str] = ()) -> list[Continuation]:
        """:meth:`greedy` after the same ``query`` on each notebook, decoded as one batch
        (:meth:`continue_greedy_batch`); each row equals :meth:`greedy` up to float error."""
        if not notebooks:
            raise EmptyInputError("greedy_batch needs at least one notebook")
        for nb in notebooks:
            validate.greedy_args(self, nb, query, max_new_tokens, stop)
            if not len(nb) and (query is None or (isinstance(query, str) and not query)):
                raise EmptyInputError("nothing to continue: a notebook and the query are empty")
        steps = [self._feed_query(nb, query) for nb in notebooks]
        return self.continue_greedy_batch([s.notebook for s in steps],
                                          torch.stack([s.logits for s in steps]),
                                          max_new_tokens, stop=stop)

    @torch.inference_mode()
    def continue_greedy_batch(self, notebooks: Sequence[Notebook], logits: torch.Tensor,
                              max_new_tokens: int, *, stop: Sequence[str] = ()
                              ) -> list[Continuation]:
        """:meth:`continue_greedy` for many notebooks at once: one forward per generated token
        for the whole batch instead of one per row and token (what a GPU wants; on a CPU too, a
        decode step's cost being mostly the read of the weights).

        ``logits`` (FloatTensor[b, vocab]) are each notebook's next-token logits, e.g. after a
        query fed with :meth:`forward`. Each row stops as :meth:`continue_greedy` does (end of
        sequence, a ``stop`` string, ``max_new_tokens``) and equals it up to float error; rows
        that stopped ride along until the last one does, their outputs ignored. The
        notebooks may differ in length (left-padded, see :meth:`forward_batch`); the generated
        notes live in a batch cache that is dropped, so no notebook is returned or changed.
        """
        if not notebooks:
            raise EmptyInputError("continue_greedy_batch needs at least one notebook")
        if logits.dim() != 2 or logits.shape[0] != len(notebooks):
            raise InvalidArgumentError(f"continue_greedy_batch needs one row of logits per notebook "
                                       f"([{len(notebooks)}, vocab]), got {tuple(logits.shape)}")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        starts = self._batch_starts(notebooks)
        b = len(notebooks)
        cache, pads = build_padded_cache(notebooks)
        mask = self._padding_mask(pads, len(notebooks[0]) + pads[0])  # grows by one per step
        out: list[list[int]] = [[] for _ in range(b)]
        done = [False] * b
        first = logits
        for _ in range(max_new_tokens):
            tokens = logits.argmax(-1).tolist()
            for r in range(b):
                if done[r]:
                    continue
                out[r].append(int(tokens[r]))
                done[r] = (tokens[r] in self.eos_ids or len(out[r]) == max_new_tokens
                           or bool(stop) and any(s in self.decode(out[r]) for s in stop))
            if all(done):
                break
            # a row that stopped feeds its last token again at position 0: any valid input
            # does, its logits are never read
            positions = [0 if done[r] else starts[r] + len(out[r]) - 1 for r in range(b)]
            self.adapter.check_positions(torch.tensor([p for p, d in zip(positions, done,
                                                                         strict=True) if not d]))
            mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long)], dim=1)
            step = self._call(cache, [[row[-1]] for row in out],
                              torch.cat([self.adapter.position_ids(torch.tensor([p]))
                                         for p in positions], dim=-2),
                              attention_mask=mask.to(self.device))
            logits = step.logits[:, -1].float()
        return [Continuation(self.decode([t for t in row if t not in self.eos_ids]), row,
                             first[r]) for r, row in enumerate(out)]

    def _batch_starts(self, notebooks: Sequence[Notebook]) -> list[int]:
        """Each notebook's next position, after checking it belongs to this model."""
        for nb in notebooks:
            nb.check_same_model(self.fingerprint, what="extend a notebook with")
        return [nb.next_position for nb in notebooks]

    def _batch_positions(self, starts: Sequence[int], q: int) -> torch.Tensor:
        """The position_ids of ``q`` new tokens per row, row ``r`` starting at ``starts[r]``
        (checked against the model's maximum)."""
        rows = [torch.arange(s, s + q) for s in starts]  # [q] each
        for positions in rows:
            self.adapter.check_positions(positions)
        return torch.cat([self.adapter.position_ids(p) for p in rows], dim=-2)  # [..., b, q]

    def _padding_mask(self, pads: Sequence[int], width: int) -> torch.Tensor:
        """LongTensor[b, width]: ones, with zeros on each row's left pads (on the CPU)."""
        mask = torch.ones(len(pads), width, dtype=torch.long)
        for r, pad in enumerate(pads):
            mask[r, :pad] = 0
        return mask

    def layer_notes(self, nb: Notebook, ids: Sequence[int], layer: int) -> LayerKV:
        """The notes ``ids`` write at ``layer`` when fed on top of ``nb``.

        The forward stops once ``layer`` has written them, so it costs ``(layer + 1) /
        num_layers`` of a full one. Returns the new tokens' keys and values only.
        """
        blocks = decoder_layers(self.model)
        if not 0 <= layer < len(blocks):
            raise ValueError(f"layer must be in 0..{len(blocks) - 1}, got {layer}")
        ids = [int(i) for i in ids]
        nb.check_same_model(self.fingerprint, what="extend a notebook with")
        positions = torch.arange(nb.next_position, nb.next_position + len(ids))  # [q]
        self.adapter.check_positions(positions)
        cache = build_cache([nb])  # filled layer by layer until the forward stops
        handle = (blocks[layer + 1].register_forward_pre_hook(_raise_stop)
                  if layer + 1 < len(blocks) else None)
        try:
            self._call(cache, [ids], self.adapter.position_ids(positions))
        except _Stop:
            pass
        finally:
            if handle is not None:
                handle.remove()
        hf: Any = cache.layers[layer]  # a full-attention layer: the notebook cache holds no other kind
        return LayerKV(hf.keys[..., len(nb):, :], hf.values[..., len(nb):, :])  # a fresh batch copy

    @torch.inference_mode()
    def _call(self, cache: Any, ids: list[list[int]], position_ids: torch.Tensor, *,
              attentions: bool = False, all_logits: bool = False, **model_kwargs: Any) -> Any:
        """The model call itself (the only one in kvnotes); checks are the callers' job."""
        keep_one = self.keeps_logits and not all_logits
        kwargs: dict[str, Any] = {"logits_to_keep": 1} if keep_one else {}
        kwargs.update(model_kwargs)
        rows, n_new = len(ids), len(ids[0])
        self.work.add(rows * n_new, self.cost.flops(
            n_new, cache.get_seq_length(), rows=rows, logit_rows=rows if keep_one else rows * n_new))
        previous = None
        model: Any = self.model  # a transformers PreTrainedModel (nn.Module types it loosely)
        if attentions:  # attention weights exist only in the eager implementation
            previous = model.config._attn_implementation
            model.set_attn_implementation("eager")
            kwargs["output_attentions"] = True
        try:
            return self.model(input_ids=torch.tensor(ids, device=self.device),  # [b, q]
                              position_ids=position_ids.to(self.device),
                              cache=cache, use_cache=True, **kwargs)
        finally:
            if previous is not None:
                model.set_attn_implementation(previous)

    # ---- notebooks from text ----------------------------------------------------------------
    def prefill(self, x: TokenInput, start: int = 0, *, bos: bool | None = None,
                kind: str = "text", name: str = "text") -> Notebook:
        """Prefill ``x`` alone with its first token at position ``start``.

        Text and documents get BOS first when the tokenizer adds one by default; token ids are
        taken as given. Raises :class:`EmptyInputError` for empty input and
        :class:`PositionError` for positions past the model's maximum. A notebook prefilled
        from a document remembers it (``nb.meta["document"]``) so its fields can be edited.
        """
        validate.prefill_args(self, x, start, bos, name)
        validate.choice(kind, "kind", SPAN_KINDS)
        ids, spans = self.tokens_of(x, bos=bos, kind=kind, name=name)
        nb = self.forward(self.empty(start), ids, spans=spans).notebook
        if isinstance(x, Document):
            offset = spans[0].end if spans and spans[0].name == "bos" else 0
            nb = nb.with_meta(document=document_meta(x, offset))
        return nb

    def extend(self, nb: Notebook, x: TokenInput, *, kind: str = "text",
               name: str = "text") -> Notebook:
        """Prefill ``x`` on top of ``nb`` (it attends to every note before it); never adds BOS."""
        validate.extend_args(self, nb, x)
        ids, spans = self.tokens_of(x, bos=False, kind=kind, name=name)
        return self.forward(nb, ids, spans=spans).notebook

    def anchor_ids(self, after: str | Sequence[int] | torch.Tensor | None = None, *,
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
            validate.token_ids(ids, "after", validate.vocab_size(self))
            return ids
        if after is not None:
            validate.text(after, "after")
        if anchor == "auto":
            anchor = "bos" if self.adds_bos else "none"
        prefix: list[int] = []
        if anchor == "bos":
            bos = self.bos_id if self.bos_id is not None else self.tokenizer.bos_token_id
            if bos is None:
                raise KvnotesError("anchor='bos' needs a tokenizer with a BOS token; use "
                                   "anchor='none'")
            prefix.append(int(bos))
        return prefix + (self.encode(after) if after else [])

    def compile(self, text: str, *, name: str = "skill",
                after: str | Sequence[int] | torch.Tensor | None = None,
                anchor: str = "auto") -> Notebook:
        """Compile a skill: ``text`` prefilled once, ready to be spliced anywhere.

        The skill is prefilled behind :meth:`anchor_ids` ``(after, anchor=anchor)``, whose
        notes are then dropped: the skill keeps its true positions (``len(prefix)`` on) and its
        notes were written attending to that prefix, as they will be in a context that starts
        with it. With no prefix at all it sits alone at position 0 and its first token becomes
        an attention sink the real context never has. The default is the context's own start
        (a BOS when the tokenizer adds one); ``after=header`` anchors it behind the system
        header it will follow, which shrinks the splice error for the skill right after it
        (and, less, for later ones). The prefix's length and :func:`prefix_digest` are kept in
        ``meta`` (``prefix_len``, ``prefix_digest``): :meth:`compose` splices a skill placed
        right after that very prefix as it is (its notes are exactly a prefill's).

        Example:
            >>> skill = engine.compile(policy, after=system_header)    # doctest: +SKIP
            >>> nb = engine.compose([engine.compile(system_header), skill, request])  # doctest: +SKIP
        """
        validate.compile_args(text, name)
        prefix = self.anchor_ids(after, anchor=anchor)
        ids, _ = self.tokens_of(text, bos=False)
        nb = self.forward(self.empty(0), [*prefix, *ids]).notebook.slice(len(prefix))
        bos = "bos" if prefix[:1] == [self.bos_id] and self.bos_id is not None else "none"
        return nb.with_spans([Span(name, "skill", 0, len(ids))]).with_meta(
            kind="skill", name=name, anchor=bos, after_tokens=len(prefix) - (bos == "bos"),
            prefix_len=len(prefix), prefix_digest=prefix_digest(prefix))

    def recompute(self, nb: Notebook, indices: Sequence[int] | torch.Tensor) -> Notebook:
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
        nb.check_same_model(self.fingerprint, what="recompute notes of")
        return self._recompute_runs(nb, idx, in_place=False)

    def _recompute_runs(self, nb: Notebook, idx: list[int], *, in_place: bool) -> Notebook:
        """:meth:`recompute` of sorted indices; ``in_place`` for a notebook whose storage only
        the caller views (compose's own), else the first run writes into a copy."""
        logits = None
        for a, b in _runs(idx):
            ids = nb.token_ids[a:b].tolist()
            position_ids = self.adapter.position_ids(nb.positions[a:b].clone())
            # the forward writes rows [a, b) again, attending to the notes before a
            nb, out = nb.rewritten(a, b, self._feeder(ids, position_ids), in_place=in_place)
            in_place = True  # later runs write into the copy the first one made
            logits = out.logits[0, -1].float() if b == len(nb) else None
        return nb.with_logits(logits)

    def repair_choice(self, nb: Notebook, at: int, k: int, *, select: str = "first",
                      layer: int = 1) -> tuple[list[int], float]:
        """Which ``k`` of the notes spliced at ``nb[at:]`` a boundary repair recomputes, in
        order, and what choosing them cost in token-equivalents: ``"first"`` takes the first
        ``k`` (free); ``"kv_deviation"`` the ``k`` whose ``layer`` notes deviate most from a
        recompute's (:meth:`note_deviation`, a partial forward over the spliced tokens)."""
        repair_selector(select, "compose")
        if not 0 <= at <= len(nb) or not 0 <= k <= len(nb) - at:
            raise InvalidArgumentError(f"repair_choice needs 0 <= at <= {len(nb)} and 0 <= k <= "
                                       f"the {len(nb) - at} notes after at; got at={at}, k={k}")
        if not k:
            return [], 0.0
        if select == "kv_deviation":
            scores = self.note_deviation(nb, at, layer)  # [len(nb) - at]
            chosen = sorted((torch.topk(scores, k).indices + at).tolist())
            return chosen, (len(nb) - at) * (layer + 1) / self.adapter.num_layers
        return list(range(at, at + k)), 0.0

    def note_deviation(self, nb: Notebook, start: int, layer: int = 1) -> torch.Tensor:
        """FloatTensor[len(nb) - start]: how far each note of ``nb`` from ``start`` on is, at
        ``layer``, from the note a recompute of those tokens on top of ``nb[:start]`` writes
        (summed norms of the key and value differences), as CacheBlend selects tokens.

        The forward stops once ``layer`` has written its notes, so it costs ``(layer + 1) /
        num_layers`` of a recompute of ``len(nb) - start`` tokens.
        """
        if not 1 <= layer < self.adapter.num_layers:
            raise InvalidArgumentError(
                f"deviation layer must be in 1..{self.adapter.num_layers - 1} (layer 0's notes "
                f"depend on the token alone), got {layer}")
        new = self.layer_notes(nb.slice(0, start), nb.token_ids[start:].tolist(), layer)
        dk = (new.keys - nb.keys(layer)[..., start:, :]).float().norm(dim=-1).sum(dim=(0, 1))
        dv = (new.values - nb.values(layer)[..., start:, :]).float().norm(dim=-1).sum(dim=(0, 1))
        return (dk + dv).cpu()

    def compose(self, parts: Sequence[Part], *, start: int = 0,
                repair: Repair | float | int = DEFAULT_REPAIR, layer: int = 1) -> Notebook:
        """One contiguous notebook from text, documents and compiled skills, in order.

        Text and documents are prefilled in place (attending to everything before them);
        skills are re-rotated to their new positions and spliced. When the tokenizer adds BOS,
        the notebook starts with one.

        ``repair`` (a :class:`~kvnotes.core.repair.Repair`; a number is
        :func:`~kvnotes.core.repair.as_repair`'s shared budget, 0 the bare splice) says which
        spliced notes are recomputed in context, right after each splice, so later parts
        attend to repaired notes. By default the first 32 tokens of every spliced skill are
        recomputed, each region ending at :func:`~kvnotes.core.repair.repaired_end` (on a
        multiple of ``repair.align``): on BFCL live_multiple this kept the tool choice of the
        exact prompt in 92% (SmolLM2) and 95% (Gemma 3) of cases, against 68% and 66% for the
        bare splice, and costs a prefill of those tokens, about 15% of the spliced tokens for
        tool descriptions of ~200 tokens (docs/results.md, BFCL). A skill placed at the very
        position it was compiled at, right after the very prefix it was compiled behind
        (``meta["prefix_digest"]``), with every note before it exact (text, or skills so
        placed), already holds a prefill's notes and is not repaired (``repair.skip_exact``):
        e.g. a header compiled alone, then a skill compiled ``after=`` it. A skill whose
        positions are not consecutive (image tokens of an M-RoPE prefill) is spliced as it is:
        its token ids alone cannot recompute it.

        ``repair.budget`` recomputes further tokens on top of that, among those not yet
        repaired (exact placements excluded): a float in (0, 1] is a fraction of them (rounded
        up), an int a token count; it is shared among the skills in proportion to those tokens,
        and ``repair.select`` picks them: ``"first"`` the tokens that follow each repaired
        region, ``"kv_deviation"`` those whose notes at ``layer`` deviate most from a recompute
        (CacheBlend's choice; the selection pass costs ``(layer + 1) / num_layers`` of
        recomputing the rest of the skill). Every spliced token repaired (``repair=1.0``, or
        ``Repair(first=n)`` with ``n`` at least each skill's length) equals a full prefill up
        to float error; ``repair=0`` splices only.

        ``nb.meta["compose"]`` counts tokens ``reused`` (spliced and kept), ``computed``
        (text prefilled), ``repaired`` (spliced, then recomputed) and ``select_tokens`` (the
        selection pass in token-equivalents), gives ``compute_fraction`` (what was run through
        the model as a fraction of a full prefill), ``regions`` (the ``[start, end)`` token
        ranges recomputed as skills' first tokens), ``exact`` (the indices of the parts
        spliced as they are because exactly placed), ``select`` and ``repair`` (the Repair's
        :meth:`~kvnotes.core.repair.Repair.tag`).
        """
        validate.compose_args(self, parts, start)
        if not parts:
            raise EmptyInputError("compose needs at least one part")
        plan = as_repair(repair)
        repair_selector(plan.select, "compose")
        repair_budget(plan.budget, 0)  # a bad budget is refused before any model work
        pieces: list[Notebook | tuple[list[int], list[Span]]] = []
        for i, part in enumerate(parts):
            if isinstance(part, Notebook):
                part.check_same_model(self.fingerprint, what="splice a skill into")
                if not len(part):
                    raise EmptyInputError(f"part {i} is an empty notebook")
                pieces.append(part)
            elif isinstance(part, (str, Document)):
                ids, spans = self.tokens_of(part, bos=False, name=f"part{i}")
                if isinstance(part, Document):
                    spans = [s if s.kind == "field" else Span(f"part{i}.{s.name}", s.kind, s.start,
                                                             s.end) for s in spans]
                pieces.append((ids, spans))
            else:
                raise TypeError(f"compose parts are str, Document or Notebook, got {type(part)}")
        regions, exact = self._repair_regions(pieces, start, plan)
        rest = [end - r for r, end in regions.values()]
        budgets = iter(split_budget(repair_budget(plan.budget, sum(rest)), rest))
        total = sum(len(p) if isinstance(p, Notebook) else len(p[0]) for p in pieces)
        # one allocation of the final size: no buffer grows (and copies) while composing
        nb = self.empty(start, capacity=total + int(self.adds_bos))
        reused = computed = repaired = 0
        select_tokens = 0.0
        done: list[list[int]] = []
        if self.adds_bos:
            nb = self.forward(nb, [self.bos_id], spans=[Span("bos", "text", 0, 1)]).notebook  # type: ignore[list-item]
            computed += 1
        for i, piece in enumerate(pieces):
            if not isinstance(piece, Notebook):
                nb = self.forward(nb, piece[0], spans=piece[1]).notebook
                computed += len(piece[0])
                continue
            at = len(nb)
            nb = nb.splice(piece)  # re-rotated straight into nb's storage
            if i not in regions:  # exactly placed (its notes are a prefill's), or not from ids
                reused += len(piece)
                continue
            r, _ = regions[i]
            first = list(range(at, r))
            if first:
                done.append([at, r])
            if first and plan.select != "first":  # the selection reads repaired notes
                nb = self._recompute_runs(nb, first, in_place=True)
                first = []
            k = next(budgets)
            chosen, cost = self.repair_choice(nb, r, k, select=plan.select, layer=layer)
            select_tokens += cost
            if first or chosen:  # nb's storage is compose's own: repaired in place
                nb = self._recompute_runs(nb, first + chosen, in_place=True)
            repaired += r - at + k
            reused += len(piece) - (r - at) - k
        fraction = (computed + repaired + select_tokens) / max(1, len(nb))
        return nb.with_meta(compose={
            "reused": reused, "computed": computed, "repaired": repaired,
            "select": plan.select, "select_tokens": select_tokens,
            "compute_fraction": fraction, "regions": done, "exact": exact,
            "repair": plan.tag()})

    def _repair_regions(self, pieces: Sequence[Notebook | tuple[list[int], list[Span]]],
                        start: int, plan: Repair) -> tuple[dict[int, tuple[int, int]], list[int]]:
        """Which spliced pieces :meth:`compose` repairs: by part index, ``(r, end)``, the end of
        the first tokens' region ``[at, r)`` (:func:`repaired_end` in absolute positions) and
        of the piece's span; and the indices of the pieces spliced as they are because exactly
        placed. A piece whose positions are not consecutive (image tokens of an M-RoPE
        prefill) is in neither: its notes need more than its token ids to recompute."""
        ids = [] if self.bos_id is None else [self.bos_id]
        exact_so_far = True  # every note before the next piece is a prefill's
        regions: dict[int, tuple[int, int]] = {}
        exact: list[int] = []
        for i, piece in enumerate(pieces):
            at = len(ids)
            if not isinstance(piece, Notebook):
                ids.extend(piece[0])
                continue
            end = at + len(piece)
            meta = piece.meta
            if (plan.skip_exact and exact_so_far and meta.get("prefix_len") == at
                    and piece.start_position == start + at
                    and meta.get("prefix_digest") == prefix_digest(ids)):
                exact.append(i)
            elif not torch.equal(piece.positions.cpu(), torch.arange(
                    piece.start_position, piece.start_position + len(piece))):
                exact_so_far = False
            else:
                r = repaired_end(start + at, start + end, plan.first, plan.align) - start
                regions[i] = (r, end)
                exact_so_far = exact_so_far and r == end
            ids.extend(piece.token_ids.tolist())
        return regions, exact

    # ---- reading the model's next move ------------------------------------------------------
    def next_logits(self, nb: Notebook, query: TokenInput | None = None) -> torch.Tensor:
        """FloatTensor[vocab]: the next-token logits after feeding ``query`` on top of ``nb``.

        With no query, the logits after the notebook's own last token: kept with the notebook
        by the forward that wrote it, else that token is fed again on top of the rest (exactly
        the prefill's logits). Nothing is appended to ``nb``'s storage either way.
        """
        validate.query_args(self, nb, query)
        if query is None or (isinstance(query, str) and not query):
            if not len(nb):
                raise EmptyInputError("an empty notebook has no next-token logits; give a query")
            if nb.last_logits is not None:
                return nb.last_logits
            last = nb.slice(0, len(nb) - 1)
            return self.probe(last, [int(nb.token_ids[-1])], every_position=False)[-1]
        ids, _ = self.tokens_of(query, bos=False, kind="query", name="query")
        return self.probe(nb, ids, every_position=False)[-1]

    def _feed_query(self, nb: Notebook, query: TokenInput | None) -> Step:
        if query is None or (isinstance(query, str) and not query):
            if nb.last_logits is not None:  # kept by the forward that wrote the last token
                return Step(nb, nb.last_logits, None)
            last = nb.slice(0, len(nb) - 1)
            return self.forward(last, [int(nb.token_ids[-1])])
        ids, spans = self.tokens_of(query, bos=False, kind="query", name="query")
        return self.forward(nb, ids, spans=spans)

    def greedy(self, nb: Notebook, query: TokenInput | None, max_new_tokens: int = 32,
               *, stop: Sequence[str] = ()) -> Generation:
        """Greedy decoding after ``query``: text, ids and the notebook holding everything."""
        validate.greedy_args(self, nb, query, max_new_tokens, stop)
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if query is None or (isinstance(query, str) and not query):
            if not len(nb):
                raise EmptyInputError("nothing to continue: the notebook and query are empty")
        step = self._feed_query(nb, query)
        return self.continue_greedy(step.notebook, step.logits, max_new_tokens, stop=stop)

    def continue_greedy(self, nb: Notebook, logits: torch.Tensor, max_new_tokens: int,
                        *, stop: Sequence[str] = ()) -> Generation:
        """The one decode loop: greedy tokens after ``nb``, whose next-token logits are ``logits``.

        Stops at an end-of-sequence token (kept in ``token_ids``, left out of the text), when the
        text so far contains one of ``stop``, or after ``max_new_tokens`` tokens.
        """
        first_logits = logits
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = int(logits.argmax())
            out.append(token)
            if token in self.eos_ids:
                break
            if stop and any(s in self.decode(out) for s in stop):
                break
            if len(out) == max_new_tokens:
                break
            step = self.forward(nb, [token])
            nb, logits = step.notebook, step.logits
        text = self.decode([t for t in out if t not in self.eos_ids])
        return Generation(text=text, token_ids=out, notebook=nb, first_logits=first_logits)

    def generate(self, nb: Notebook, query: TokenInput | None = None,
                 max_new_tokens: int = 32) -> str:
        """Greedy continuation text after ``query`` on top of ``nb``."""
        return self.greedy(nb, query, max_new_tokens).text

class _Stop(Exception):
    """Raised by a forward pre-hook to end a forward once the wanted layer has run."""


def _raise_stop(*_: Any) -> None:
    raise _Stop


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's decoder blocks, in order."""
    n = text_config(model).num_hidden_layers
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers) == n:
        return layers
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    raise KvnotesError(f"cannot find the decoder layers of {type(model).__name__}; "
                       "layer_notes needs them (use select='attention' to edit instead)")


def _blocks_or_none(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    try:
        return decoder_layers(model)
    except KvnotesError:
        return None


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return ids
