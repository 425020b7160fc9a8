"""The Engine: a model runner with the verbs over notebooks.

:class:`Engine` is a :class:`~kvnotes.core.runner.ModelRunner` (tokens, the one forward, the
model call) plus prefill, extend, next_logits and greedy decoding, :meth:`Engine.continue_greedy`
being the one decode loop. Batched decoding (:mod:`kvnotes.core.batch`) and compile, compose
and boundary repair (:mod:`kvnotes.core.compose`) are functions over a runner, bound here as
the engine's methods. Editing fields is :func:`kvnotes.edit` in the ops layer, above the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import kvnotes.core.batch as batch_ops
import kvnotes.core.compose as compose_ops
import kvnotes.core.validate as validate
from kvnotes.core.document import Document, document_meta
from kvnotes.core.errors import EmptyInputError
from kvnotes.core.model_defaults import ModelDefaults, model_defaults
from kvnotes.core.notebook import SPAN_KINDS, Notebook
from kvnotes.core.runner import ModelRunner, TokenInput


@dataclass(frozen=True, slots=True)
class Generation:
    """A greedy continuation: its text, its token ids and the notebook that now holds them."""

    text: str
    token_ids: list[int]
    notebook: Notebook
    first_logits: torch.Tensor  # FloatTensor[vocab] at the first generated position


class Engine(ModelRunner):
    """A transformers causal LM wrapped for notebook work.

    Example:
        >>> engine = kvnotes.load("smollm2-135m")                     # doctest: +SKIP
        >>> nb = engine.prefill("The capital of France is")           # doctest: +SKIP
        >>> engine.generate(nb, "", max_new_tokens=3)                  # doctest: +SKIP
    """

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer: Any, *, name: str | None = None) -> Engine:
        """Wrap any already-loaded transformers causal LM (tiny random ones too)."""
        return cls(model, tokenizer, name=name)

    @property
    def defaults(self) -> ModelDefaults | None:
        """This model's calibrated repair and guard (:mod:`kvnotes.core.model_defaults`), looked
        up by the name it was loaded by; None for a model nobody calibrated."""
        return model_defaults(self.name)

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

    def greedy(self, nb: Notebook, query: TokenInput | None, max_new_tokens: int = 32,
               *, stop: Sequence[str] = ()) -> Generation:
        """Greedy decoding after ``query``: text, ids and the notebook holding everything."""
        validate.greedy_args(self, nb, query, max_new_tokens, stop)
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if query is None or (isinstance(query, str) and not query):
            if not len(nb):
                raise EmptyInputError("nothing to continue: the notebook and query are empty")
        step = self.feed_query(nb, query)
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

    # ---- batched decoding (kvnotes.core.batch) ----------------------------------------------
    forward_batch = batch_ops.forward_batch
    greedy_batch = batch_ops.greedy_batch
    continue_greedy_batch = batch_ops.continue_greedy_batch

    # ---- compile, compose and boundary repair (kvnotes.core.compose) ------------------------
    anchor_ids = compose_ops.anchor_ids
    compile = compose_ops.compile_skill
    compile_skills = compose_ops.compile_skills
    compose = compose_ops.compose
    recompute = compose_ops.recompute
    repair_choice = compose_ops.repair_choice
    note_deviation = compose_ops.note_deviation
