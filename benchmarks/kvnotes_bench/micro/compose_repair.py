"""Composition fidelity against boundary repair budget, with and without header anchoring.

Each case is composed as [system header skill][policy skills...] and answered with one request
(the customer's context and question), exactly as the demo does; the reference is a full
prefill of the same token ids. For every case we compare the next-token logits at the first
answer token (KL(recompute ‖ compose), logit cosine, top-1 agreement, both sides' top-2 margins)
under:

- anchor ``start``: skills compiled behind the context's own start (a BOS when the tokenizer adds
  one, else alone at position 0), the default; anchor ``header``: compiled
  ``after=`` the system header they follow in every context;
- repair budgets 0, 2.5%, 5%, 10% of the spliced tokens, selected as each skill's first tokens
  (``first``) or by early-layer KV deviation (``kv_deviation``, CacheBlend's choice; its
  selection pass is counted in the compute fraction).

Cases: the demo's four plus fresh ones written for this benchmark (two or three skills, in new
orders, new customers). Top-1 agreement is reported overall and where the recompute margin
exceeds 0.1 logit (a flip on a closer near-tie is visible as such). Accuracy only; no timing.
    .venv/bin/python -m kvnotes_bench.micro.compose_repair --models smollm2-135m gemma3-270m \
        --out out/compose-repair
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kvnotes.apps.demo import SYSTEM_INTRO, DemoCase, demo_data
from kvnotes.core.chat import chat_frame
from kvnotes.core.engine import Engine
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.machine import machine_info, set_threads
from kvnotes.core.metrics import LogitComparison, compare_logits
from kvnotes.core.models import load
from kvnotes.core.repair import Repair, selectors_for

BUDGETS = (0, 0.025, 0.05, 0.10)
SELECTORS = selectors_for("compose")
# kv_deviation's selection pass costs a forward to an early layer per case and condition;
# on a loaded 2-core machine it is measured at the larger budgets, header-anchored only
DEVIATION = {"anchors": ("header",), "budgets": (0.05, 0.10)}
ANCHORS = ("start", "header")
NEAR_TIE = 0.1

FRESH = [
    DemoCase("fresh-damaged-tent", ["order_tools", "refund_policy", "shipping_policy"],
             "Customer: Noor Rahman (customer C-50213), Trailhead member.\nOrder N-70114: "
             "a two-person tent, delivered 5 days ago with a torn rain fly, paid by card.\n"
             "Message: The tent arrived damaged. I want a replacement shipped fast.",
             "Should the agent offer a free replacement? Answer yes or no, then explain."),
    DemoCase("fresh-gift-card", ["shipping_policy", "refund_policy"],
             "Customer: Jon Ekberg (customer C-18840), not a loyalty member.\nOrder N-70377: "
             "a fleece jacket bought with a gift card, delivered 12 days ago, unworn.\n"
             "Message: Please refund the jacket to my credit card instead of the gift card.",
             "Can the refund go to Jon's credit card? Answer yes or no, then explain."),
    DemoCase("fresh-express-late", ["refund_policy", "shipping_policy", "order_tools"],
             "Customer: Ines Duarte (customer C-62001).\nOrder N-70921: hiking boots, express "
             "shipping paid, delivered 4 business days late.\nMessage: I paid for express and "
             "it came late. Do I get the shipping fee back?",
             "Is Ines owed the express shipping fee? Answer yes or no, then explain."),
    DemoCase("fresh-cancel", ["order_tools", "shipping_policy"],
             "Customer: Pavel Novak (customer C-77310).\nOrder N-71002: a sleeping bag, status "
             "processing, not shipped yet.\nMessage: I changed my mind, please cancel the order.",
             "What tool call should the agent make? Answer with the call only."),
]


@dataclass(frozen=True, slots=True)
class RepairRow:
    """One case composed under one anchor, selector and budget, against recompute."""

    case: str
    fresh: bool  # written for this benchmark (not one of the demo's cases)
    anchor: str
    select: str  # "none" without repair
    budget: float
    repaired: int
    spliced: int
    compute_fraction: float
    logits: LogitComparison

    def to_dict(self) -> dict[str, Any]:
        return {"case": self.case, "fresh": self.fresh, "anchor": self.anchor,
                "select": self.select, "budget": self.budget, "repaired": self.repaired,
                "spliced": self.spliced, "compute_fraction": self.compute_fraction,
                **self.logits.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RepairRow:
        logits = LogitComparison.from_dict(d)
        return cls(case=d["case"], fresh=d["fresh"], anchor=d["anchor"], select=d["select"],
                   budget=d["budget"], repaired=d["repaired"], spliced=d["spliced"],
                   compute_fraction=d["compute_fraction"], logits=logits)


@dataclass(frozen=True, slots=True)
class BudgetSummary:
    """Every case under one anchor, selector and budget."""

    anchor: str
    select: str
    budget: float
    n: int
    kl_median: float
    kl_max: float
    cosine_min: float
    top1_agree: int
    top1_agree_clear: int  # among the cases whose recompute margin exceeds NEAR_TIE
    clear: int
    compute_fraction_median: float
    repaired_fraction: float

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BudgetSummary:
        return cls(**{f.name: d[f.name] for f in fields(cls)})


@dataclass(frozen=True, slots=True)
class ModelRun:
    """One model's rows (every case under every condition) and their summary per condition."""

    model: str
    cases: tuple[str, ...]
    rows: tuple[RepairRow, ...]
    summary: tuple[BudgetSummary, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "cases": list(self.cases),
                "rows": [r.to_dict() for r in self.rows],
                "summary": [asdict(s) for s in self.summary]}


    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelRun:
        return cls(model=d["model"], cases=tuple(d["cases"]),
                   rows=tuple(RepairRow.from_dict(r) for r in d["rows"]),
                   summary=tuple(BudgetSummary.from_dict(s) for s in d["summary"]))


@dataclass(frozen=True)
class ComposeRepairConfig:
    """One run: every model of ``models``, on the demo's cases and the first ``fresh`` of
    ``FRESH``, on ``threads`` torch threads (None: the machine's physical cores)."""

    models: tuple[str, ...] = ("smollm2-135m", "gemma3-270m")
    threads: int | None = 2
    fresh: int = len(FRESH)

    def __post_init__(self) -> None:
        if not self.models:
            raise InvalidArgumentError("models is empty: name at least one (e.g. smollm2-135m)")
        if not 0 <= self.fresh <= len(FRESH):
            raise InvalidArgumentError(f"fresh must be between 0 and {len(FRESH)} (the fresh "
                                       f"cases there are), got {self.fresh}")


@dataclass(frozen=True)
class ComposeRepairResult:
    """What one run measured; :meth:`to_dict` is ``compose-repair.json``'s schema."""

    machine: dict[str, Any]  # a kvnotes.core.machine.machine_info record, before the run
    budgets: tuple[float, ...]
    near_tie: float
    models: tuple[ModelRun, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"machine": self.machine, "budgets": list(self.budgets), "near_tie": self.near_tie,
                "models": [m.to_dict() for m in self.models]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ComposeRepairResult:
        return cls(machine=d["machine"], budgets=tuple(d["budgets"]), near_tie=d["near_tie"],
                   models=tuple(ModelRun.from_dict(m) for m in d["models"]))


def run_model(engine: Engine, name: str, fresh: int = len(FRESH),
              say: Callable[[str], None] | None = print) -> ModelRun:
    """Every case under every condition on ``engine`` (``name`` labels it); ``say`` gets the
    rows so far, one JSON line per case (a killed run keeps them)."""
    skills, cases = demo_data()
    cases = [*cases, *FRESH[:fresh]]
    head, middle, tail = chat_frame(engine.tokenizer)
    header_text = head + SYSTEM_INTRO
    texts = {n: t + "\n" for n, t in skills.items()}
    header = engine.compile(header_text, name="header")
    compiled = {
        "start": {n: engine.compile(t, name=n) for n, t in texts.items()},
        "header": {n: engine.compile(t, name=n, after=header_text) for n, t in texts.items()},
    }
    rows: list[RepairRow] = []
    for case in cases:
        query = middle + case.context + "\n\n" + case.question + tail
        parts0 = [header, *(compiled["start"][s] for s in case.skills)]
        ids = engine.compose(parts0, repair=0).token_ids
        reference = engine.next_logits(engine.prefill(ids), query)
        for anchor in ANCHORS:
            parts = [header, *(compiled[anchor][s] for s in case.skills)]
            for select in SELECTORS:
                for budget in BUDGETS:
                    if budget == 0 and select != SELECTORS[0]:
                        continue  # no repair: the selector plays no part
                    if select == "kv_deviation" and (anchor not in DEVIATION["anchors"]
                                                     or budget not in DEVIATION["budgets"]):
                        continue
                    nb = engine.compose(parts, repair=Repair(first=0, skip_exact=False, budget=budget,
                                                          select=select))
                    assert nb.token_ids.tolist() == ids.tolist()
                    stats = nb.meta["compose"]
                    rows.append(RepairRow(
                        case=case.name, fresh=case in FRESH, anchor=anchor,
                        select=select if budget else "none", budget=budget,
                        repaired=stats["repaired"], spliced=stats["reused"] + stats["repaired"],
                        compute_fraction=stats["compute_fraction"],
                        logits=compare_logits(reference, engine.next_logits(nb, query))))
        if say is not None:
            say(json.dumps({"model": name, "case": case.name,
                            "rows": [r.to_dict() for r in rows if r.case == case.name]}))
    return ModelRun(name, tuple(c.name for c in cases), tuple(rows), summarize(rows))


def summarize(rows: Sequence[RepairRow]) -> tuple[BudgetSummary, ...]:
    out = []
    keys = sorted({(r.anchor, r.select, r.budget) for r in rows},
                  key=lambda k: (ANCHORS.index(k[0]), k[2], k[1]))
    for anchor, select, budget in keys:
        rs = [r for r in rows if (r.anchor, r.select, r.budget) == (anchor, select, budget)]
        clear = [r for r in rs if r.logits.top2_margin_reference > NEAR_TIE]
        out.append(BudgetSummary(
            anchor=anchor, select=select, budget=budget, n=len(rs),
            kl_median=statistics.median(r.logits.kl for r in rs),
            kl_max=max(r.logits.kl for r in rs),
            cosine_min=min(r.logits.cosine for r in rs),
            top1_agree=sum(r.logits.top1_agree for r in rs),
            top1_agree_clear=sum(r.logits.top1_agree for r in clear), clear=len(clear),
            compute_fraction_median=statistics.median(r.compute_fraction for r in rs),
            repaired_fraction=sum(r.repaired for r in rs) / max(1, sum(r.spliced for r in rs)),
        ))
    return tuple(out)


def table(models: Sequence[ModelRun]) -> str:
    lines = ["| model | anchor | select | budget | KL median | KL max | min cosine | top-1 "
             f"(margin > {NEAR_TIE}) | top-1 (all) | compute fraction (median) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for m in models:
        for s in m.summary:
            lines.append(
                f"| {m.model} | {s.anchor} | {s.select} | {s.budget:.1%} | "
                f"{s.kl_median:.4f} | {s.kl_max:.4f} | {s.cosine_min:.4f} | "
                f"{s.top1_agree_clear}/{s.clear} | {s.top1_agree}/{s.n} | "
                f"{s.compute_fraction_median:.3f} |")
    return "\n".join(lines)


def plot(models: Sequence[ModelRun], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models, strict=True):
        for anchor in ANCHORS:
            for select in SELECTORS:
                pts = sorted((s.budget, s.kl_median) for s in m.summary
                             if s.anchor == anchor and s.select in (select, "none"))
                ax.plot([100 * b for b, _ in pts], [k for _, k in pts], "o-" if anchor ==
                        "header" else "s--", label=f"anchor={anchor}, select={select}")
        ax.axhline(0.02, color="grey", lw=0.8, ls=":", label="KL 0.02 (goal)")
        ax.set_yscale("log")
        ax.set_xlabel("repair budget (% of spliced tokens)")
        ax.set_ylabel("KL(recompute ‖ compose), median over cases")
        ax.set_title(m.model)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(config: ComposeRepairConfig, engine: Engine | None = None,
        say: Callable[[str], None] | None = print,
        saved: Callable[[ComposeRepairResult], None] | None = None) -> ComposeRepairResult:
    """Every model of ``config`` (``engine``: the one model's, instead of loading it; only when
    ``config`` names one); ``saved`` gets the result so far after each model."""
    if engine is not None and len(config.models) != 1:
        raise InvalidArgumentError(f"an engine stands for one model, but the config names "
                                   f"{len(config.models)}: pass one model, or no engine")
    set_threads(config.threads)
    machine = machine_info()
    runs: list[ModelRun] = []
    result = ComposeRepairResult(machine, BUDGETS, NEAR_TIE, ())
    for name in config.models:
        runs.append(run_model(load(name) if engine is None else engine, name, config.fresh, say))
        result = ComposeRepairResult(machine, BUDGETS, NEAR_TIE, tuple(runs))
        if saved is not None:
            saved(result)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--out", type=Path, default=Path("out/compose-repair"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fresh", type=int, default=len(FRESH), help="fresh cases to add")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    def save(result: ComposeRepairResult) -> None:
        (args.out / "compose-repair.json").write_text(json.dumps(result.to_dict(), indent=1))

    config = ComposeRepairConfig(models=tuple(args.models), threads=args.threads,
                                 fresh=args.fresh)
    result = run(config, say=lambda line: print(line, flush=True), saved=save)
    plot(result.models, args.out / "compose-repair.png")
    (args.out / "compose-repair.md").write_text(table(result.models) + "\n")
    print(table(result.models))


if __name__ == "__main__":
    main()
