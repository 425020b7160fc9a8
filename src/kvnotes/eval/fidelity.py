"""Composed notes against full recompute of the same tokens, at the query."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from kvnotes.core.compose import Part
from kvnotes.core.engine import Engine
from kvnotes.core.metrics import compare_logits
from kvnotes.core.repair import DEFAULT_REPAIR, Repair
from kvnotes.core.runner import TokenInput


@dataclass(frozen=True, slots=True)
class FidelityReport:
    """Composed vs recompute at the decision position, and what each cost."""

    logit_cosine: float
    kl: float  # KL(recompute || composed)
    top1_agree: bool
    top2_margin: float  # recompute's gap between its top two logits (small = near-tie)
    composed_margin: float  # the composed side's own gap (known without recompute)
    continuation_identical: bool
    recompute_text: str
    composed_text: str
    tokens_total: int  # every token up to the decision: composed parts + query
    tokens_reused: int  # spliced from compiled skills
    tokens_computed: int  # prefilled at request time: text parts + repaired tokens + query
    tokens_repaired: int  # spliced, then recomputed in context (compose's ``repair``)
    compute_fraction: float  # tokens_computed (+ repair selection) / tokens_total
    ttft_recompute_s: float  # full prefill of context + query
    ttft_compose_s: float  # compose (splice + prefill of the rest) + query

    @property
    def speedup(self) -> float:
        return self.ttft_recompute_s / self.ttft_compose_s if self.ttft_compose_s else float("inf")

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "speedup": self.speedup}


def fidelity(engine: Engine, parts: Sequence[Part], query: TokenInput, *,
             max_new_tokens: int = 16,
             repair: Repair | float | int = DEFAULT_REPAIR) -> FidelityReport:
    """Compose ``parts``, recompute the same token ids from scratch, compare at ``query``.

    Skills among ``parts`` must already be compiled (compile time is not part of TTFT: a skill
    is compiled once and reused). ``repair`` goes to :meth:`Engine.compose` (its default
    recomputes each spliced skill's first tokens; ``repair=0`` measures the bare splice). Both
    sides then decode ``max_new_tokens`` greedily, as one batch (:meth:`Engine.greedy_batch`:
    equal to decoding each alone up to float error). Both sides' top-2 margins are reported, so
    a top-1 flip on a near-tie shows as one.
    """
    t0 = time.perf_counter()
    composed = engine.compose(parts, start=0, repair=repair)
    composed_logits = engine.next_logits(composed, query)
    ttft_compose = time.perf_counter() - t0

    t0 = time.perf_counter()
    reference = engine.prefill(composed.token_ids, start=composed.start_position)
    reference_logits = engine.next_logits(reference, query)
    ttft_recompute = time.perf_counter() - t0

    cmp = compare_logits(reference_logits, composed_logits)
    # both continuations in one batch: one forward per token for the pair (not timed)
    recompute_text, composed_text = (c.text for c in engine.greedy_batch(
        [reference, composed], query, max_new_tokens))
    stats = composed.meta.get("compose", {})
    query_tokens = len(engine.tokens_of(query, bos=False)[0])
    computed = (int(stats.get("computed", len(composed))) + int(stats.get("repaired", 0))
                + query_tokens)
    return FidelityReport(
        logit_cosine=cmp.cosine, kl=cmp.kl, top1_agree=cmp.top1_agree,
        top2_margin=cmp.top2_margin_reference, composed_margin=cmp.top2_margin_method,
        continuation_identical=recompute_text == composed_text,
        recompute_text=recompute_text, composed_text=composed_text,
        tokens_total=len(composed) + query_tokens, tokens_reused=int(stats.get("reused", 0)),
        tokens_computed=computed,
        tokens_repaired=int(stats.get("repaired", 0)),
        compute_fraction=(computed + float(stats.get("select_tokens", 0.0)))
        / (len(composed) + query_tokens),
        ttft_recompute_s=ttft_recompute, ttft_compose_s=ttft_compose,
    )
