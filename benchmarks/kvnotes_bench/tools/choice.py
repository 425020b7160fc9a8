"""The tool choice as a decision: the candidate name a decoder constrained to the candidates
writes after ``{"name": "``, scored on full names.

At each step the allowed next tokens are those that continue some candidate's name (its
tokens, encoded on their own) and, where a candidate's name is complete there, its end (the
best logit of any token that starts with a closing quote). The best allowed option is taken;
the walk stops as soon as one candidate is left. Where the candidates share no first token
this is first-token scoring; names with a common prefix (``get_weather`` / ``get_time``) are
told apart on the tokens where they part. The decision's margin is the smallest gap between
the best and the runner-up option over the steps that had a choice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch

from kvnotes.core.engine import Engine
from kvnotes.core.notebook import Notebook
from kvnotes.ops.decisions import Decision

END = -1  # the option "the name is complete here"


@dataclass(frozen=True, slots=True)
class NameTrie:
    """Candidate names as token sequences, and the tokens that can close a name."""

    names: tuple[str, ...]
    ids: tuple[tuple[int, ...], ...]
    closers: torch.Tensor  # LongTensor[c]: tokens whose text starts with '"'


@cache
def _closers(engine: Engine) -> torch.Tensor:
    # raw vocabulary strings: byte-level BPE and SentencePiece both spell '"' as itself, and
    # a token with a leading space (Ġ or ▁) does not close a name written right after it
    found = [i for tok, i in engine.tokenizer.get_vocab().items() if tok.startswith('"')]
    return torch.tensor(sorted(found), dtype=torch.long)


def name_trie(engine: Engine, names: Sequence[str]) -> NameTrie:
    unique = tuple(dict.fromkeys(names))
    return NameTrie(unique, tuple(tuple(engine.encode(n)) for n in unique), _closers(engine))


def _options(trie: NameTrie, live: Sequence[int], depth: int) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i in live:
        seq = trie.ids[i]
        out.setdefault(seq[depth] if depth < len(seq) else END, []).append(i)
    return out


@torch.inference_mode()
def choose(engine: Engine, nb: Notebook, logits: torch.Tensor, trie: NameTrie) -> Decision:
    """The constrained decoder's choice on ``nb`` (which already holds the call opening), whose
    next-token logits are ``logits``. ``decision.scores`` holds each candidate's score at the
    step where it dropped out (its option's logit there); the chosen one keeps its last."""
    live = list(range(len(trie.names)))
    prefix: list[int] = []
    scores: dict[str, float] = {}
    margin = math.inf
    step_logits = logits
    while len(live) > 1:
        options = _options(trie, live, len(prefix))
        if len(options) > 1:
            value = {o: float(step_logits[o]) if o != END
                     else float(step_logits[trie.closers].max()) for o in options}
            ranked = sorted(value, key=value.__getitem__, reverse=True)
            margin = min(margin, value[ranked[0]] - value[ranked[1]])
            for o in ranked:
                for i in options[o]:
                    scores[trie.names[i]] = value[o]
            best = ranked[0]
        else:
            best = next(iter(options))
        if best == END:
            live = options[END][:1]  # equal names were merged: one ends here
            break
        live = options[best]
        if len(live) == 1:
            break
        prefix.append(best)
        step_logits = engine.probe(nb, prefix, every_position=False)[-1]
    answer = trie.names[live[0]]
    return Decision(answer, scores, margin if math.isfinite(margin) else math.nan, logits)
