"""The Engine: one model, its tokenizer and its position adapter, and the verbs over notebooks.

Reads like a small inference stack: ``_run`` feeds tokens on top of a notebook and returns the
longer notebook plus the last logits; everything else (prefill, extend, compile, compose,
next_logits, generate) is a few lines over it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from kvnotes.core.document import Document, document_meta, encode
from kvnotes.core.errors import EmptyInputError, KvnotesError
from kvnotes.core.fingerprint import ModelFingerprint
from kvnotes.core.notebook import LayerKV, Notebook, Span
from kvnotes.core.positions import adapter_for

TokenInput = str | Sequence[int] | torch.Tensor | Document
Part = str | Document | Notebook


@dataclass(frozen=True, slots=True)
class Generation:
    """A greedy continuation: its text, its token ids and the notebook that now holds them."""

    text: str
    token_ids: list[int]
    notebook: Notebook
    first_logits: torch.Tensor  # FloatTensor[vocab] at the first generated position


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
        self.tokenizer = tokenizer
        self.name = name or str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
        self.adapter = adapter_for(model)
        self.fingerprint = ModelFingerprint.of(model, tokenizer)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        probe = tokenizer("a")["input_ids"]
        bos = getattr(tokenizer, "bos_token_id", None)
        # BOS rule: a notebook starts with BOS exactly when tokenizer(text) would add one.
        self.bos_id: int | None = bos if bos is not None and probe and probe[0] == bos else None
        self.eos_ids: set[int] = _eos_ids(model, tokenizer)
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

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
    def empty(self, start: int = 0) -> Notebook:
        """A notebook with no tokens whose first token will sit at ``start``."""
        self.adapter.check_positions(torch.tensor([start]))
        return Notebook((), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                        (), self.adapter, self.fingerprint, origin=start)

    @torch.inference_mode()
    def _forward(self, nb: Notebook, ids: Sequence[int], **model_kwargs: Any
                 ) -> tuple[Any, DynamicCache, torch.Tensor]:
        """The one forward: ``ids`` on top of ``nb`` -> (model output, filled cache, positions).

        Extra keyword arguments go to the model (e.g. ``output_attentions``).
        """
        nb.check_same_model(self.fingerprint, what="extend a notebook with")
        positions = torch.arange(nb.next_position, nb.next_position + len(ids))  # [q]
        self.adapter.check_positions(positions)
        cache = nb.to_cache()
        kwargs: dict[str, Any] = {"logits_to_keep": 1} if self._keeps_logits else {}
        out = self.model(
            input_ids=torch.tensor([list(ids)], device=self.device),  # [1, q]
            position_ids=self.adapter.position_ids(positions).to(self.device),
            cache=cache, use_cache=True, **kwargs, **model_kwargs,
        )
        return out, cache, positions

    def _run(self, nb: Notebook, ids: Sequence[int], spans: Sequence[Span] = ()
             ) -> tuple[Notebook, torch.Tensor]:
        """Feed ``ids`` on top of ``nb``: the longer notebook and the last token's logits."""
        out, cache, positions = self._forward(nb, ids)
        layers = tuple(LayerKV(layer.keys, layer.values) for layer in cache.layers)
        offset = len(nb)
        longer = Notebook(
            layers=layers,
            token_ids=torch.cat([nb.token_ids, torch.tensor(list(ids), dtype=torch.long)]),
            positions=torch.cat([nb.positions, positions]),
            spans=[*nb.spans, *(s.moved(offset) for s in spans)],
            adapter=self.adapter, fingerprint=self.fingerprint, meta=nb.meta, origin=nb._origin,
        )
        return longer, out.logits[0, -1].float()

    # ---- notebooks from text ----------------------------------------------------------------
    def prefill(self, x: TokenInput, start: int = 0, *, bos: bool | None = None,
                kind: str = "text", name: str = "text") -> Notebook:
        """Prefill ``x`` alone with its first token at position ``start``.

        Text and documents get BOS first when the tokenizer adds one by default; token ids are
        taken as given. Raises :class:`EmptyInputError` for empty input and
        :class:`PositionError` for positions past the model's maximum. A notebook prefilled
        from a document remembers it (``nb.meta["document"]``) so its fields can be edited.
        """
        ids, spans = self.tokens_of(x, bos=bos, kind=kind, name=name)
        nb = self._run(self.empty(start), ids, spans)[0]
        if isinstance(x, Document):
            offset = spans[0].end if spans and spans[0].name == "bos" else 0
            nb = nb.with_meta(document=document_meta(x, offset))
        return nb

    def extend(self, nb: Notebook, x: TokenInput, *, kind: str = "text",
               name: str = "text") -> Notebook:
        """Prefill ``x`` on top of ``nb`` (it attends to every note before it); never adds BOS."""
        ids, spans = self.tokens_of(x, bos=False, kind=kind, name=name)
        return self._run(nb, ids, spans)[0]

    def compile(self, text: str, *, name: str = "skill", anchor: str = "auto") -> Notebook:
        """Compile a skill: ``text`` prefilled alone, ready to be spliced anywhere.

        ``anchor`` decides what the skill's first token sees. ``"none"``: truly alone at
        position 0, so its first token becomes an attention sink the real context never has.
        ``"bos"``: prefilled behind a BOS whose notes are then dropped, so the skill keeps
        positions 1..L and sees the same sink a BOS-led context gives it. ``"auto"`` picks
        ``"bos"`` when the tokenizer adds BOS by default, else ``"none"``.
        """
        if anchor not in ("auto", "bos", "none"):
            raise ValueError(f"anchor must be 'auto', 'bos' or 'none', got {anchor!r}")
        if anchor == "auto":
            anchor = "bos" if self.adds_bos else "none"
        ids, _ = self.tokens_of(text, bos=False)
        if anchor == "bos":
            bos = self.bos_id if self.bos_id is not None else self.tokenizer.bos_token_id
            if bos is None:
                raise KvnotesError("anchor='bos' needs a tokenizer with a BOS token")
            nb = self._run(self.empty(0), [bos, *ids])[0].slice(1)
        else:
            nb = self._run(self.empty(0), ids)[0]
        return nb.with_spans([Span(name, "skill", 0, len(ids))]).with_meta(
            kind="skill", name=name, anchor=anchor)

    def compose(self, parts: Sequence[Part], *, start: int = 0) -> Notebook:
        """One contiguous notebook from text, documents and compiled skills, in order.

        Text and documents are prefilled in place (attending to everything before them);
        skills are re-rotated to their new positions and spliced, not recomputed. When the
        tokenizer adds BOS, the notebook starts with one. ``nb.meta["compose"]`` counts the
        tokens reused and computed.
        """
        if not parts:
            raise EmptyInputError("compose needs at least one part")
        nb = self.empty(start)
        reused = computed = 0
        for i, part in enumerate(parts):
            if not len(nb) and self.adds_bos:
                nb = self._run(nb, [self.bos_id], [Span("bos", "text", 0, 1)])[0]  # type: ignore[list-item]
                computed += 1
            if isinstance(part, Notebook):
                part.check_same_model(self.fingerprint, what="splice a skill into")
                if not len(part):
                    raise EmptyInputError(f"part {i} is an empty notebook")
                nb = Notebook.concat([nb, part.moved_to(nb.next_position)], meta=nb.meta)
                reused += len(part)
            elif isinstance(part, (str, Document)):
                ids, spans = self.tokens_of(part, bos=False, name=f"part{i}")
                if isinstance(part, Document):
                    spans = [s if s.kind == "field" else Span(f"part{i}.{s.name}", s.kind, s.start,
                                                             s.end) for s in spans]
                nb = self._run(nb, ids, spans)[0]
                computed += len(ids)
            else:
                raise TypeError(f"compose parts are str, Document or Notebook, got {type(part)}")
        return nb.with_meta(compose={"reused": reused, "computed": computed})

    # ---- reading the model's next move ------------------------------------------------------
    def next_logits(self, nb: Notebook, query: TokenInput | None = None) -> torch.Tensor:
        """FloatTensor[vocab]: the next-token logits after feeding ``query`` on top of ``nb``.

        With no query, the logits after the notebook's own last token (that token is fed again
        on top of the rest, which gives exactly the prefill's logits).
        """
        if query is None or (isinstance(query, str) and not query):
            if not len(nb):
                raise EmptyInputError("an empty notebook has no next-token logits; give a query")
            return self._run(nb.slice(0, len(nb) - 1), [int(nb.token_ids[-1])])[1]
        ids, spans = self.tokens_of(query, bos=False, kind="query", name="query")
        return self._run(nb, ids, spans)[1]

    @torch.inference_mode()
    def greedy(self, nb: Notebook, query: TokenInput | None, max_new_tokens: int = 32,
               *, stop: Sequence[str] = ()) -> Generation:
        """Greedy decoding after ``query``: text, ids and the notebook holding everything."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if query is None or (isinstance(query, str) and not query):
            if not len(nb):
                raise EmptyInputError("nothing to continue: the notebook and query are empty")
            nb, logits = self._run(nb.slice(0, len(nb) - 1), [int(nb.token_ids[-1])])
        else:
            ids, spans = self.tokens_of(query, bos=False, kind="query", name="query")
            nb, logits = self._run(nb, ids, spans)
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
            nb, logits = self._run(nb, [token])
        text = self.decode([t for t in out if t not in self.eos_ids])
        return Generation(text=text, token_ids=out, notebook=nb, first_logits=first_logits)

    def generate(self, nb: Notebook, query: TokenInput | None = None,
                 max_new_tokens: int = 32) -> str:
        """Greedy continuation text after ``query`` on top of ``nb``."""
        return self.greedy(nb, query, max_new_tokens).text

    # ---- editing ------------------------------------------------------------------------------
    def edit(self, nb: Notebook, field: str, new_value: str, strategy: str = "erratum",
             **options: Any) -> tuple[Notebook, Any]:
        """Change a field of a prefilled document; see :func:`kvnotes.ops.edit.edit`.

        Edit strategies live in the ops layer, above the engine; they register their entry
        point here (``register_editor``) when ``kvnotes`` is imported, so the engine never
        imports upward.
        """
        if _EDITOR is None:
            raise KvnotesError("no edit strategies are registered; import kvnotes first")
        return _EDITOR(self, nb, field, new_value, strategy=strategy, **options)


EditFn = Callable[..., tuple[Notebook, Any]]
_EDITOR: EditFn | None = None


def register_editor(fn: EditFn) -> EditFn:
    """Install the function ``Engine.edit`` delegates to (``kvnotes.ops.edit.edit``)."""
    global _EDITOR
    _EDITOR = fn
    return fn


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return ids
