"""Batched decoding: one forward for many notebooks, rows left-padded to one width.

Functions over a :class:`~kvnotes.core.runner.ModelRunner` (the engine's ``forward_batch``,
``greedy_batch`` and ``continue_greedy_batch`` delegate here); each row equals the one-notebook
verb up to float error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import kvnotes.core.validate as validate
from kvnotes.core.cache import build_padded_cache
from kvnotes.core.errors import EmptyInputError, InvalidArgumentError
from kvnotes.core.notebook import Notebook
from kvnotes.core.runner import ModelRunner, TokenInput


@dataclass(frozen=True, slots=True)
class Continuation:
    """One row of :func:`greedy_batch`: a :class:`~kvnotes.core.engine.Generation` without its
    notebook (the rows' generated notes live in one batch cache that is dropped)."""

    text: str
    token_ids: list[int]
    first_logits: torch.Tensor  # FloatTensor[vocab] at the first generated position


def forward_batch(engine: ModelRunner, notebooks: Sequence[Notebook], ids: Sequence[int]
                  ) -> torch.Tensor:
    """FloatTensor[b, vocab]: the logits after ``ids`` on top of each notebook, in one forward.

    The notebooks may differ in length and positions (they are left-padded and the pads
    masked, see :func:`~kvnotes.core.cache.build_padded_cache`); each row equals
    :meth:`~kvnotes.core.runner.ModelRunner.forward` on that notebook up to float error.
    """
    if not notebooks:
        raise EmptyInputError("forward_batch needs at least one notebook")
    ids = [int(i) for i in ids]
    if not ids:
        raise EmptyInputError("forward_batch needs at least one token")
    starts = _batch_starts(engine, notebooks)
    cache, pads = build_padded_cache(notebooks)
    width = len(notebooks[0]) + pads[0]
    padded: dict[str, Any] = (  # unpadded: the model's own causal mask is enough
        {"attention_mask": _padding_mask(pads, width + len(ids)).to(engine.device)}
        if any(pads) else {})
    out = engine.call_model(cache, [ids] * len(notebooks),
                            _batch_positions(engine, starts, len(ids)), **padded)
    return out.logits[:, -1].float()  # [b, vocab]


def greedy_batch(engine: ModelRunner, notebooks: Sequence[Notebook], query: TokenInput | None,
                 max_new_tokens: int = 32, *, stop: Sequence[str] = ()) -> list[Continuation]:
    """The engine's ``greedy`` after the same ``query`` on each notebook, decoded as one batch
    (:func:`continue_greedy_batch`); each row equals ``greedy`` up to float error."""
    if not notebooks:
        raise EmptyInputError("greedy_batch needs at least one notebook")
    for nb in notebooks:
        validate.greedy_args(engine, nb, query, max_new_tokens, stop)
        if not len(nb) and (query is None or (isinstance(query, str) and not query)):
            raise EmptyInputError("nothing to continue: a notebook and the query are empty")
    steps = [engine.feed_query(nb, query) for nb in notebooks]
    return continue_greedy_batch(engine, [s.notebook for s in steps],
                                 torch.stack([s.logits for s in steps]), max_new_tokens,
                                 stop=stop)


@torch.inference_mode()
def continue_greedy_batch(engine: ModelRunner, notebooks: Sequence[Notebook],
                          logits: torch.Tensor, max_new_tokens: int, *,
                          stop: Sequence[str] = ()) -> list[Continuation]:
    """The engine's ``continue_greedy`` for many notebooks at once: one forward per generated
    token for the whole batch instead of one per row and token (what a GPU wants; on a CPU too, a
    decode step's cost being mostly the read of the weights).

    ``logits`` (FloatTensor[b, vocab]) are each notebook's next-token logits, e.g. after a
    query fed with ``forward``. Each row stops as ``continue_greedy`` does (end of
    sequence, a ``stop`` string, ``max_new_tokens``) and equals it up to float error; rows
    that stopped ride along until the last one does, their outputs ignored. The
    notebooks may differ in length (left-padded, see :func:`forward_batch`); the generated
    notes live in a batch cache that is dropped, so no notebook is returned or changed.
    """
    if not notebooks:
        raise EmptyInputError("continue_greedy_batch needs at least one notebook")
    if logits.dim() != 2 or logits.shape[0] != len(notebooks):
        raise InvalidArgumentError(f"continue_greedy_batch needs one row of logits per notebook "
                                   f"([{len(notebooks)}, vocab]), got {tuple(logits.shape)}")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    starts = _batch_starts(engine, notebooks)
    b = len(notebooks)
    cache, pads = build_padded_cache(notebooks)
    mask = _padding_mask(pads, len(notebooks[0]) + pads[0])  # grows by one per step
    out: list[list[int]] = [[] for _ in range(b)]
    done = [False] * b
    first = logits
    for _ in range(max_new_tokens):
        tokens = logits.argmax(-1).tolist()
        for r in range(b):
            if done[r]:
                continue
            out[r].append(int(tokens[r]))
            done[r] = (tokens[r] in engine.eos_ids or len(out[r]) == max_new_tokens
                       or bool(stop) and any(s in engine.decode(out[r]) for s in stop))
        if all(done):
            break
        # a row that stopped feeds its last token again at position 0: any valid input
        # does, its logits are never read
        positions = [0 if done[r] else starts[r] + len(out[r]) - 1 for r in range(b)]
        engine.adapter.check_positions(torch.tensor([p for p, d in zip(positions, done,
                                                                       strict=True) if not d]))
        mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long)], dim=1)
        step = engine.call_model(cache, [[row[-1]] for row in out],
                                 torch.cat([engine.adapter.position_ids(torch.tensor([p]))
                                            for p in positions], dim=-2),
                                 attention_mask=mask.to(engine.device))
        logits = step.logits[:, -1].float()
    return [Continuation(engine.decode([t for t in row if t not in engine.eos_ids]), row,
                         first[r]) for r, row in enumerate(out)]


def _batch_starts(engine: ModelRunner, notebooks: Sequence[Notebook]) -> list[int]:
    """Each notebook's next position, after checking it belongs to this model."""
    for nb in notebooks:
        nb.check_same_model(engine.fingerprint, what="extend a notebook with")
    return [nb.next_position for nb in notebooks]


def _batch_positions(engine: ModelRunner, starts: Sequence[int], q: int) -> torch.Tensor:
    """The position_ids of ``q`` new tokens per row, row ``r`` starting at ``starts[r]``
    (checked against the model's maximum)."""
    rows = [torch.arange(s, s + q) for s in starts]  # [q] each
    for positions in rows:
        engine.adapter.check_positions(positions)
    return torch.cat([engine.adapter.position_ids(p) for p in rows], dim=-2)  # [..., b, q]


def _padding_mask(pads: Sequence[int], width: int) -> torch.Tensor:
    """LongTensor[b, width]: ones, with zeros on each row's left pads (on the CPU)."""
    mask = torch.ones(len(pads), width, dtype=torch.long)
    for r, pad in enumerate(pads):
        mask[r, :pad] = 0
    return mask
