"""Comparisons at the decision position: logit cosine, KL, top-1 agreement.

Definitions (docs/design.md, Conventions): cosine of the full next-token logit vectors; KL(reference ‖ method)
over the softmax distributions; top-1 agreement of the argmax tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kvnotes.core.records import adapter


@dataclass(frozen=True, slots=True)
class LogitComparison:
    """How a method's next-token logits compare with the reference (full recompute)."""

    cosine: float
    kl: float  # KL(reference || method), nats
    top1_reference: int
    top1_method: int
    top2_margin_reference: float  # logit gap between the reference's top two tokens
    # the method's own gap, known without any recompute (what a decision guard can look at)
    top2_margin_method: float = float("nan")

    @property
    def top1_agree(self) -> bool:
        return self.top1_reference == self.top1_method

    def to_dict(self) -> dict[str, float | int | bool]:
        return {**asdict(self), "top1_agree": self.top1_agree}

    @classmethod
    def from_dict(cls, data: object) -> LogitComparison:
        """Reads :meth:`to_dict`'s output (``top1_agree`` is derived, so not read)."""
        out: LogitComparison = adapter(cls).validate_python(data)
        return out


def logit_cosine(reference: torch.Tensor, method: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(
        reference.double().reshape(1, -1), method.double().reshape(1, -1)))


def kl_divergence(reference: torch.Tensor, method: torch.Tensor) -> float:
    """KL(P_reference || P_method) in nats, from raw logits."""
    log_p = torch.log_softmax(reference.double(), dim=-1)
    log_q = torch.log_softmax(method.double(), dim=-1)
    return max(0.0, float((log_p.exp() * (log_p - log_q)).sum()))


def compare_logits(reference: torch.Tensor, method: torch.Tensor) -> LogitComparison:
    top2 = reference.double().topk(2).values
    top2_method = method.double().topk(2).values
    return LogitComparison(
        cosine=logit_cosine(reference, method),
        kl=kl_divergence(reference, method),
        top1_reference=int(reference.argmax()),
        top1_method=int(method.argmax()),
        top2_margin_reference=float(top2[0] - top2[1]),
        top2_margin_method=float(top2_method[0] - top2_method[1]),
    )


def normalized_effect(m_patched: float, m_old: float, m_new: float) -> float:
    """(m_patched - m_old) / (m_new - m_old): 0 = still the old run, 1 = fully the new run."""
    denominator = m_new - m_old
    if denominator == 0:
        return float("nan")
    return (m_patched - m_old) / denominator
