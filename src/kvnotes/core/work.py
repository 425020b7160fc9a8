"""The arithmetic a forward costs, counted per model call, so a benchmark can put a latency ratio
beside the ratio the arithmetic itself allows.

A dense decoder's forward of ``n`` new tokens on top of ``past`` cached ones costs, in the model
used here (the usual one, e.g. Kaplan et al. 2020, with attention counted exactly):

* 2 FLOPs per weight of the decoder blocks per token (every matmul: projections and MLP);
* 2 FLOPs per weight of the output head per logit row kept (one row per sequence when only the
  last token's logits are kept, as kvnotes does unless asked for every position);
* 4 x heads x head_dim FLOPs per layer per (query, key) pair attended: the scores and the mix.
  Query ``i`` attends to ``past + i + 1`` keys, or to the last ``window`` of them in a
  sliding-window layer.

Norms, rotary embeddings and softmax are left out (under 1% for the bundled models). On a CPU a
forward is compute-bound, so FLOPs predict its time to within the kernels' efficiency; on a GPU
small forwards are bound by memory and launches instead, and FLOPs say less.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch


def keys_attended(n_new: int, past: int, window: int | None = None) -> int:
    """Sum over ``n_new`` queries (after ``past`` cached tokens) of the keys each attends to."""
    total = n_new * past + n_new * (n_new + 1) // 2  # query i sees past + i + 1 keys
    if window is None or past + n_new <= window:
        return total
    # queries past the window's reach see exactly `window` keys; the rest see past + i + 1
    first_capped = max(0, window - past)  # queries 0 .. first_capped-1 are uncapped
    uncapped = min(first_capped, n_new)
    return (uncapped * past + uncapped * (uncapped + 1) // 2) + (n_new - uncapped) * window


class CausalLM(Protocol):
    """What :meth:`CostModel.of` reads of a transformers causal LM."""

    config: Any  # a transformers PretrainedConfig

    def get_input_embeddings(self) -> Any: ...

    def get_output_embeddings(self) -> Any: ...

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...


@dataclass(frozen=True, slots=True)
class CostModel:
    """The FLOPs of a forward for one model's shapes (see the module docstring)."""

    body_weights: int  # matmul weights of the decoder blocks
    head_weights: int  # the output head (vocab x hidden)
    attention_width: int  # heads x head_dim of the queries, per layer
    windows: tuple[int | None, ...]  # per layer: the sliding window, or None (full attention)

    @classmethod
    def of(cls, model: CausalLM, blocks: torch.nn.ModuleList | None = None) -> CostModel:
        """The shapes of ``model``; ``blocks``: its decoder blocks (when not given, every 2-D
        weight but the embeddings counts as the body)."""
        config = model.config.get_text_config(decoder=True)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        head = model.get_output_embeddings()
        embed = model.get_input_embeddings().weight
        head_weights = head.weight.numel() if head is not None else embed.numel()
        if blocks is not None:
            body = sum(p.numel() for p in blocks.parameters() if p.dim() >= 2)
        else:
            skip = {id(embed)} | ({id(head.weight)} if head is not None else set())
            body = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in skip)
        window = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None)
        if types is not None:  # the config names each layer's kind
            windows = tuple(window if t == "sliding_attention" else None for t in types)
        else:
            windows = (window if window else None,) * config.num_hidden_layers
        return cls(body, head_weights, heads * head_dim, windows)

    def flops(self, n_new: int, past: int = 0, *, rows: int = 1, logit_rows: int | None = None
              ) -> float:
        """FLOPs of one forward: ``rows`` sequences of ``n_new`` tokens on ``past`` cached ones,
        keeping ``logit_rows`` rows of logits (default one per sequence)."""
        logit_rows = rows if logit_rows is None else logit_rows
        pairs = sum(keys_attended(n_new, past, w) for w in self.windows)
        return float(rows * (2 * self.body_weights * n_new + 4 * self.attention_width * pairs)
                     + 2 * self.head_weights * logit_rows)

    def attention_share(self, n_new: int, past: int) -> float:
        """Share of a forward's FLOPs that the ``past`` tokens add (attending to them): one
        minus it is the best ``alone / over past`` time ratio a compute-bound forward allows."""
        total = self.flops(n_new, past)
        return (total - self.flops(n_new, 0)) / total


@dataclass(frozen=True, slots=True)
class Work:
    """An amount of work: model calls, tokens fed and FLOPs (:class:`CostModel`)."""

    calls: int = 0
    tokens: int = 0
    flops: float = 0.0

    def __sub__(self, other: Work) -> Work:
        return Work(self.calls - other.calls, self.tokens - other.tokens,
                    self.flops - other.flops)


@dataclass(slots=True)
class WorkCounter:
    """Work done through one engine: model calls, tokens fed and FLOPs (:class:`CostModel`).

    Take a :meth:`snapshot` before a piece of work; :meth:`since` it is that work's cost.

    Example:
        >>> counter = WorkCounter()
        >>> mark = counter.snapshot()
        >>> counter.add(tokens=10, flops=2e9)
        >>> counter.since(mark)
        Work(calls=1, tokens=10, flops=2000000000.0)
    """

    calls: int = 0
    tokens: int = 0
    flops: float = 0.0

    def add(self, tokens: int, flops: float) -> None:
        self.calls += 1
        self.tokens += tokens
        self.flops += flops

    def snapshot(self) -> Work:
        """The work counted so far (a frozen copy)."""
        return Work(self.calls, self.tokens, self.flops)

    def since(self, mark: Work) -> Work:
        """The work done since ``mark`` (a :meth:`snapshot`)."""
        return self.snapshot() - mark
