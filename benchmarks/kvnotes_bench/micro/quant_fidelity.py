"""The fidelity cost of int8 notes for composition, against fp32, on a real model.

For each (skill, context) case: compose the context with the compiled skill spliced in, ask a
query, and compare next-token logits with full recompute of the same tokens. Variants of the
skill's notes:

- ``fp32``           the compiled skill as is (the composition baseline);
- ``int8-token``     stored int8 with per-token scales, dequantized, then re-rotated in place;
- ``int8-channel``   the same with per-channel scales;
- ``int8-token-requant`` moved while quantized (dequantize → rotate → quantize), then spliced.

Reported per variant: logit cosine, KL and top-1 against recompute, the same against the fp32
composition (isolates what int8 costs), greedy continuation identity, and the file size.

    .venv/bin/python -m kvnotes_bench.micro.quant_fidelity --model smollm2-135m --out out/quant
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from kvnotes.core.engine import Engine
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.machine import set_threads
from kvnotes.core.metrics import LogitComparison, compare_logits
from kvnotes.core.models import load
from kvnotes.core.notebook import Notebook
from kvnotes.ops.quant import QuantizedNotebook, quantize

SKILLS = {
    "refunds": ("Refund policy: a customer may return any item within 30 days of delivery for a "
                "full refund. Items must be unused and in the original packaging. Refunds are "
                "paid to the original payment method within 5 business days. Digital goods and "
                "gift cards cannot be refunded. Damaged items are replaced free of charge."),
    "shipping": ("Shipping policy: standard shipping takes 3 to 5 business days and costs $4.99; "
                 "orders over $50 ship free. Express shipping takes 1 to 2 business days and "
                 "costs $14.99. We do not ship to P.O. boxes. Tracking numbers are emailed when "
                 "the parcel leaves the warehouse."),
    "escalation": ("Escalation rules: if a customer mentions a lawyer, a chargeback or a safety "
                   "issue, stop and hand the conversation to a human supervisor. Never promise a "
                   "refund above $500 without approval. Always apologise once, briefly."),
}
CONTEXTS = {
    "order": ("You are a support agent for an online shop. Answer using the policy below.\n"
              "Order 1042: a blender, delivered 12 days ago, unused, box unopened.\n"),
    "chat": ("Support chat transcript. The agent must follow company policy.\n"
             "Customer: hi, I bought a gift card last week and a kettle yesterday.\n"),
}
QUERY = "\nCustomer: can I get my money back? Answer yes or no.\nAgent:"


@dataclass(frozen=True, slots=True)
class Variant:
    """One variant of a skill's notes, composed into one context."""

    vs_recompute: LogitComparison
    vs_fp32_compose: LogitComparison  # what int8 costs on top of composition
    continuation_identical_to_recompute: bool
    continuation: str
    ttft_compose_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"vs_recompute": self.vs_recompute.to_dict(),
                "vs_fp32_compose": self.vs_fp32_compose.to_dict(),
                "continuation_identical_to_recompute": self.continuation_identical_to_recompute,
                "continuation": self.continuation, "ttft_compose_s": self.ttft_compose_s}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Variant:
        return cls(vs_recompute=LogitComparison.from_dict(d["vs_recompute"]),
                   vs_fp32_compose=LogitComparison.from_dict(d["vs_fp32_compose"]),
                   continuation_identical_to_recompute=d["continuation_identical_to_recompute"],
                   continuation=d["continuation"], ttft_compose_s=d["ttft_compose_s"])


@dataclass(frozen=True, slots=True)
class QuantCase:
    """One skill composed into one context: every variant against recompute."""

    case: str
    tokens: int
    skill_tokens: int
    recompute_continuation: str
    variants: dict[str, Variant]

    def to_dict(self) -> dict[str, Any]:
        return {"case": self.case, "tokens": self.tokens, "skill_tokens": self.skill_tokens,
                "recompute_continuation": self.recompute_continuation,
                "variants": {k: v.to_dict() for k, v in self.variants.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QuantCase:
        return cls(case=d["case"], tokens=d["tokens"], skill_tokens=d["skill_tokens"],
                   recompute_continuation=d["recompute_continuation"],
                   variants={k: Variant.from_dict(v) for k, v in d["variants"].items()})


@dataclass(frozen=True, slots=True)
class VariantSummary:
    """One variant over every case."""

    cosine_vs_recompute_median: float
    cosine_vs_recompute_min: float
    kl_vs_recompute_median: float
    top1_vs_recompute: float
    cosine_vs_fp32_compose_min: float
    kl_vs_fp32_compose_max: float
    top1_vs_fp32_compose: float
    continuation_identical: float

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> VariantSummary:
        return cls(**{f.name: d[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class QuantFidelityConfig:
    """One run: every skill of ``SKILLS`` in every context of ``CONTEXTS`` on ``model``, greedy
    continuations of ``max_new_tokens``, on ``threads`` torch threads (None: the machine's
    physical cores)."""

    model: str = "smollm2-135m"
    max_new_tokens: int = 12
    threads: int | None = 2

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidArgumentError(f"max_new_tokens must be at least 1, got "
                                       f"{self.max_new_tokens}")


@dataclass(frozen=True, slots=True)
class QuantRun:
    """What one run measured; :meth:`to_dict` is ``quant_fidelity_MODEL.json``'s schema."""

    model: str
    scheme: str
    query: str
    max_new_tokens: int
    sizes_bytes: dict[str, dict[str, int]]  # skill -> {"tokens", "fp32", "int8-token", ...}
    cases: tuple[QuantCase, ...]
    summary: dict[str, VariantSummary]

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "scheme": self.scheme, "query": self.query,
                "max_new_tokens": self.max_new_tokens, "sizes_bytes": self.sizes_bytes,
                "cases": [c.to_dict() for c in self.cases],
                "summary": {k: asdict(v) for k, v in self.summary.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QuantRun:
        return cls(model=d["model"], scheme=d["scheme"], query=d["query"],
                   max_new_tokens=d["max_new_tokens"], sizes_bytes=d["sizes_bytes"],
                   cases=tuple(QuantCase.from_dict(c) for c in d["cases"]),
                   summary={k: VariantSummary.from_dict(v) for k, v in d["summary"].items()})


def run(config: QuantFidelityConfig, engine: Engine | None = None,
        say: Callable[[str], None] = print) -> QuantRun:
    """Every case of ``config`` (``engine``: default ``config.model`` loaded)."""
    set_threads(config.threads)
    engine = load(config.model) if engine is None else engine
    cases: list[QuantCase] = []
    sizes: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for skill_name, skill_text in SKILLS.items():
            skill = engine.compile(skill_text, name=skill_name)
            fp32_bytes = skill.save(Path(tmp) / f"{skill_name}.safetensors").stat().st_size
            q_tok, q_ch = quantize(skill, "token"), quantize(skill, "channel")
            sizes[skill_name] = {
                "tokens": len(skill), "fp32": fp32_bytes,
                "int8-token": q_tok.save(Path(tmp) / f"{skill_name}.t.q8").stat().st_size,
                "int8-channel": q_ch.save(Path(tmp) / f"{skill_name}.c.q8").stat().st_size,
            }
            for ctx_name, ctx in CONTEXTS.items():
                case = _case(engine, skill, q_tok, q_ch, ctx, f"{skill_name}+{ctx_name}",
                             config.max_new_tokens)
                cases.append(case)
                cosines = {v: round(r.vs_recompute.cosine, 5) for v, r in case.variants.items()}
                say(f"{json.dumps({'case': case.case, 'tokens': case.tokens})} {cosines}")
    return QuantRun(engine.name, engine.adapter.name, QUERY, config.max_new_tokens, sizes,
                    tuple(cases), _summary(cases))


def _case(engine: Engine, skill: Notebook, q_tok: QuantizedNotebook, q_ch: QuantizedNotebook,
          ctx: str, name: str, max_new_tokens: int) -> QuantCase:
    base = engine.compose([ctx, skill], repair=0)  # the quantization error alone
    offset = int(base.positions[base.span(skill.spans[0].name).start])
    reference = engine.prefill(base.token_ids, start=base.start_position)
    ref_logits = engine.next_logits(reference, QUERY)
    ref_text = engine.generate(reference, QUERY, max_new_tokens)
    variants = {
        "fp32": skill,
        "int8-token": q_tok.dequantize(),
        "int8-channel": q_ch.dequantize(),
        "int8-token-requant": q_tok.shifted(offset - int(q_tok.positions[0].item())).dequantize(),
    }
    out: dict[str, Variant] = {}
    fp32_logits: torch.Tensor | None = None
    for label, notes in variants.items():
        t0 = time.perf_counter()
        nb = engine.compose([ctx, notes], repair=0)
        logits = engine.next_logits(nb, QUERY)
        elapsed = time.perf_counter() - t0
        fp32_logits = logits if label == "fp32" else fp32_logits
        assert fp32_logits is not None  # "fp32" is the first variant
        text = engine.generate(nb, QUERY, max_new_tokens)
        out[label] = Variant(vs_recompute=compare_logits(ref_logits, logits),
                             vs_fp32_compose=compare_logits(fp32_logits, logits),
                             continuation_identical_to_recompute=text == ref_text,
                             continuation=text, ttft_compose_s=elapsed)
    return QuantCase(name, len(base), len(skill), ref_text, out)


def _summary(cases: list[QuantCase]) -> dict[str, VariantSummary]:
    summary = {}
    for label in cases[0].variants:
        rows = [c.variants[label] for c in cases]
        summary[label] = VariantSummary(
            cosine_vs_recompute_median=statistics.median(r.vs_recompute.cosine for r in rows),
            cosine_vs_recompute_min=min(r.vs_recompute.cosine for r in rows),
            kl_vs_recompute_median=statistics.median(r.vs_recompute.kl for r in rows),
            top1_vs_recompute=sum(r.vs_recompute.top1_agree for r in rows) / len(rows),
            cosine_vs_fp32_compose_min=min(r.vs_fp32_compose.cosine for r in rows),
            kl_vs_fp32_compose_max=max(r.vs_fp32_compose.kl for r in rows),
            top1_vs_fp32_compose=sum(r.vs_fp32_compose.top1_agree for r in rows) / len(rows),
            continuation_identical=sum(r.continuation_identical_to_recompute for r in rows)
            / len(rows),
        )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", type=Path, default=Path("out/quant"))
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads (0: the machine's physical cores)")
    args = parser.parse_args()
    config = QuantFidelityConfig(model=args.model, max_new_tokens=args.max_new_tokens,
                                 threads=args.threads or None)
    result = run(config, say=lambda line: print(line, flush=True)).to_dict()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"quant_fidelity_{args.model.replace('/', '_')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))
    print(json.dumps(result["sizes_bytes"], indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
