"""The model runner: one model, its tokenizer and its position adapter, and the one forward.

:meth:`ModelRunner.forward` feeds tokens on top of a notebook and returns the longer notebook
plus the last logits; the model call itself is :meth:`ModelRunner.call_model` (the only one in
kvnotes; the notebook's own :meth:`~kvnotes.core.notebook.Notebook.append` takes the new notes
into its storage). :class:`~kvnotes.core.engine.Engine` is a runner with the verbs over
notebooks; batched decoding (:mod:`kvnotes.core.batch`) and compile and compose
(:mod:`kvnotes.core.compose`) are functions over a runner.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from kvnotes.core.attention import use_grouped_sdpa
from kvnotes.core.cache import NotebookCache, build_cache
from kvnotes.core.document import Document, added_bos, encode
from kvnotes.core.errors import EmptyInputError, KvnotesError, PositionError
from kvnotes.core.fingerprint import ModelFingerprint
from kvnotes.core.notebook import LayerKV, Notebook, Span
from kvnotes.core.positions import adapter_for
from kvnotes.core.positions.base import text_config
from kvnotes.core.storage import Claim
from kvnotes.core.work import CausalLM, CostModel, WorkCounter

TokenInput = str | Sequence[int] | torch.Tensor | Document


@dataclass(frozen=True, slots=True)
class Step:
    """One forward: the longer notebook, the last fed token's logits and the raw model output."""

    notebook: Notebook
    logits: torch.Tensor  # FloatTensor[vocab] after the last fed token
    output: Any  # the model's output (``.attentions`` when asked for)


class ModelRunner:
    """A transformers causal LM, its tokenizer and position adapter: tokens in, notes out."""

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
        # what every model call costs, counted in call_model (benchmarks read it around their work);
        # a forward that layer_notes stops early is counted whole
        self.cost = CostModel.of(cast(CausalLM, model), _blocks_or_none(model))
        self.work = WorkCounter()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, scheme={self.adapter.name!r}, "
                f"layers={self.adapter.num_layers})")

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

    def feeder(self, ids: list[int], position_ids: torch.Tensor, **call_kwargs: Any
                ) -> Callable[[Claim], Any]:
        """A writer for :meth:`Notebook.append` / :meth:`Notebook.rewritten`: one forward of
        ``ids`` whose notes go into the claimed rows; returns the model's output."""
        def feed(claim: Claim) -> Any:
            return self.call_model(NotebookCache(claim), [ids], position_ids, **call_kwargs)
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
        longer, out = nb.append(ids, positions, self.feeder(ids, position_ids,
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
        feed = self.feeder(ids, self.adapter.position_ids(positions), all_logits=every_position)
        _, out = nb.append(ids, positions, feed, keep=False)  # the rows are given back
        return out.logits[0].float()


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
            self.call_model(cache, [ids], self.adapter.position_ids(positions))
        except _Stop:
            pass
        finally:
            if handle is not None:
                handle.remove()
        hf: Any = cache.layers[layer]  # a full-attention layer: the notebook cache holds no other kind
        return LayerKV(hf.keys[..., len(nb):, :], hf.values[..., len(nb):, :])  # a fresh batch copy

    @torch.inference_mode()
    def call_model(self, cache: Any, ids: list[list[int]], position_ids: torch.Tensor, *,
              attentions: bool = False, all_logits: bool = False, **model_kwargs: Any) -> Any:
        """The model call itself (the only one in kvnotes): ``ids`` (one row per batch row) on
        top of ``cache``; checks are the callers' job."""
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


    def feed_query(self, nb: Notebook, query: TokenInput | None) -> Step:
        """``query`` fed on top of ``nb`` (none: the logits after ``nb``'s own last token)."""
        if query is None or (isinstance(query, str) and not query):
            if nb.last_logits is not None:  # kept by the forward that wrote the last token
                return Step(nb, nb.last_logits, None)
            last = nb.slice(0, len(nb) - 1)
            return self.forward(last, [int(nb.token_ids[-1])])
        ids, spans = self.tokens_of(query, bos=False, kind="query", name="query")
        return self.forward(nb, ids, spans=spans)


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
