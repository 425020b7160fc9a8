"""The demo: compile policy and tool skills once, splice them into several contexts, and show
what composition saves and how closely it matches full recompute."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from functools import partial
from importlib import resources
from pathlib import Path

from pydantic import SerializerFunctionWrapHandler, model_serializer, model_validator
from pydantic.dataclasses import dataclass as record

from kvnotes.core.chat import chat_frame
from kvnotes.core.compose import Part
from kvnotes.core.engine import Engine
from kvnotes.core.machine import MachineInfo, load_note, machine_info
from kvnotes.core.notebook import Notebook
from kvnotes.core.records import Json, JsonRecord
from kvnotes.core.repair import DEFAULT_REPAIR, Repair, as_repair
from kvnotes.eval.fidelity import FidelityReport, fidelity
from kvnotes.eval.reports import write_bundle

HEADER = "system header"
SYSTEM_INTRO = ("You are a customer support agent for Northwind Outfitters. Follow the documents "
                "below exactly.\n\n")


@dataclass(frozen=True)
class DemoCase:
    name: str
    skills: list[str]
    context: str
    question: str


def demo_data() -> tuple[dict[str, str], list[DemoCase]]:
    """The bundled demo skills (name -> text) and contexts."""
    folder = resources.files("kvnotes.apps") / "data" / "demo"
    skills = {p.name.removesuffix(".txt"): p.read_text() for p in folder.iterdir()
              if p.name.endswith(".txt")}
    cases = [DemoCase(**c) for c in json.loads((folder / "contexts.json").read_text())]
    return skills, cases


def case_parts(engine: Engine, case: DemoCase, compiled: dict[str, Notebook]) -> tuple[list[Part], str]:
    """Compose parts and the request for one case.

    The system header and every policy are compiled skills (a deployment caches them); what
    arrives with the request (the customer's context and the question) is the query, fed once.
    """
    _, middle, tail = chat_frame(engine.tokenizer)
    parts: list[Part] = [compiled[HEADER], *(compiled[name] for name in case.skills)]
    return parts, middle + case.context + "\n\n" + case.question + tail


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn`` (the caller warms up first)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@record(frozen=True, slots=True)
class CompiledSkill:
    """One skill of the demo as compiled: its length and the median compile time."""

    tokens: int
    compile_s: float
    anchor: str | None = None  # how it was compiled (e.g. behind the system header)
    after_tokens: int = 0  # tokens of the text it was compiled behind (its notes dropped)


@record(frozen=True, slots=True)
class ComposeCase:
    """One context composed from the skills, against full recompute.

    ``fidelity``'s TTFT fields hold the medians of warm runs, not its own single timing. In the
    JSON its fields (and ``speedup``) sit beside ``case`` and ``skills``.
    """

    case: str
    skills: tuple[str, ...]
    fidelity: FidelityReport

    @model_validator(mode="before")
    @classmethod
    def _nest(cls, data: object) -> object:
        if isinstance(data, dict) and "fidelity" not in data:
            names = {f.name for f in fields(FidelityReport)}
            return {"case": data["case"], "skills": data["skills"],
                    "fidelity": {k: v for k, v in data.items() if k in names}}
        return data

    @model_serializer(mode="wrap")
    def _flat(self, handler: SerializerFunctionWrapHandler) -> Json:
        out: Json = handler(self)
        report = out.pop("fidelity")
        assert isinstance(report, dict)
        return {**out, **report, "speedup": self.fidelity.speedup}


@record(frozen=True, slots=True)
class DemoTiming:
    """How the demo's times were taken, and the machine's load around them."""

    repeats: int
    warmup: int
    statistic: str
    machine_before: MachineInfo  # kvnotes.core.machine.machine_info records
    machine_after: MachineInfo
    busy: bool


@record(frozen=True, slots=True)
class ComposeDemoResult(JsonRecord):
    """The compose demo on one model: the compiled skills and every composed context
    (``to_dict``/``from_dict``: the demo's ``results.json`` or a repro stage)."""

    model: str
    skills: dict[str, CompiledSkill]
    repair: str  # the compose repair's Repair.tag()
    cases: tuple[ComposeCase, ...]
    max_new_tokens: int
    timing: DemoTiming | None = None

    @model_validator(mode="before")
    @classmethod
    def _older_results(cls, data: object) -> object:
        """Older results hold the repair as a number: a shared budget (0 or none: bare
        splice)."""
        if isinstance(data, dict) and not isinstance(data.get("repair", 0), str):
            return {**data, "repair": Repair(first=0, budget=data.get("repair", 0)).tag()}
        return data


def run_compose_demo(engine: Engine, *, max_new_tokens: int = 24, repeats: int = 3,
                     repair: Repair | float | int = DEFAULT_REPAIR,
                     progress: Callable[[str], None] | None = None) -> ComposeDemoResult:
    """Compile every skill once, then compose each case and compare with full recompute.

    Policies are compiled behind the system header (``after=``), the text that precedes them
    in every case: the first policy sits exactly where it was compiled and is spliced as it
    is; ``repair`` (:meth:`Engine.compose`'s: by default the first 32 tokens of each other
    policy recomputed in context; 0 the bare splice) says what else is recomputed.
    ``progress`` is called with each case's name when it is done.

    Timings are medians of ``repeats`` runs after one warm-up run (a single cold run on a busy
    machine can be off by an order of magnitude); the result records the machine's load.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    before = machine_info()
    skills, cases = demo_data()
    compiled: dict[str, Notebook] = {}
    compile_s: dict[str, float] = {}
    head, _, _ = chat_frame(engine.tokenizer)
    # Each policy file ends with a newline; one more leaves a blank line between spliced skills.
    texts = {HEADER: head + SYSTEM_INTRO, **{n: t + "\n" for n, t in skills.items()}}
    for name, text in texts.items():
        after = None if name == HEADER else texts[HEADER]  # policies: behind the real header
        compiled[name] = engine.compile(text, name=name, after=after)  # also the warm-up
        compile_s[name] = median_seconds(partial(engine.compile, text, name=name, after=after),
                                         repeats)
    rows: list[ComposeCase] = []
    for case in cases:
        parts, query = case_parts(engine, case, compiled)
        report = fidelity(engine, parts, query, max_new_tokens=max_new_tokens, repair=repair)
        # TTFT as medians of warm runs: recompute = one forward over every token id; compose =
        # splice the skills, then one forward over the request
        query_ids = engine.tokens_of(query, bos=False)[0]
        all_ids = engine.compose(parts, repair=0).token_ids.tolist() + query_ids  # ids only
        recompute = median_seconds(partial(_recompute_ttft, engine, all_ids), repeats)
        compose = median_seconds(partial(_compose_ttft, engine, parts, query_ids, repair),
                                 repeats)
        rows.append(ComposeCase(case.name, tuple(case.skills), replace(
            report, ttft_recompute_s=recompute, ttft_compose_s=compose)))
        if progress is not None:
            progress(case.name)
    load_after = machine_info(since=before)
    return ComposeDemoResult(
        model=engine.name,
        skills={n: CompiledSkill(len(nb), compile_s[n], nb.meta.get("anchor"),
                                 nb.meta.get("after_tokens", 0))
                for n, nb in compiled.items()},
        repair=as_repair(repair).tag(), cases=tuple(rows), max_new_tokens=max_new_tokens,
        timing=DemoTiming(repeats=repeats, warmup=1, statistic="median", machine_before=before,
                          machine_after=load_after,
                          busy=bool(before["busy"] or load_after["busy"])))


def _recompute_ttft(engine: Engine, token_ids: list[int]) -> object:
    """One forward over every token id from an empty cache (the reference's TTFT)."""
    return engine.next_logits(engine.empty(0), token_ids)


def _compose_ttft(engine: Engine, parts: Sequence[Part], query_ids: list[int],
                  repair: Repair | float | int) -> object:
    """Splice the skills, then one forward over the request (compose's TTFT)."""
    return engine.next_logits(engine.compose(parts, repair=repair), query_ids)


def render_table(result: ComposeDemoResult) -> str:
    """Markdown table of the compose results."""
    lines = [
        "| case | tokens | reused | computed | TTFT recompute (ms) | TTFT compose (ms) | speedup"
        " | logit cosine | KL | top-1 | top-2 margin recompute / compose | continuation |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---:|:---:|",
    ]
    for c in result.cases:
        r = c.fidelity
        lines.append(
            f"| {c.case} | {r.tokens_total} | {r.tokens_reused} | {r.tokens_computed}"
            f" | {r.ttft_recompute_s * 1e3:.0f} | {r.ttft_compose_s * 1e3:.0f}"
            f" | {r.speedup:.1f}x | {r.logit_cosine:.4f} | {r.kl:.4f}"
            f" | {'same' if r.top1_agree else 'DIFF'}"
            f" | {r.top2_margin:.2f} / {r.composed_margin:.2f}"
            f" | {'identical' if r.continuation_identical else 'differs'} |")
    return "\n".join(lines)


def plot(result: ComposeDemoResult, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [c.fidelity for c in result.cases]
    names = [c.case for c in result.cases]
    x = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar([i - 0.2 for i in x], [r.ttft_recompute_s * 1e3 for r in rows], 0.4,
            label="full recompute")
    ax1.bar([i + 0.2 for i in x], [r.ttft_compose_s * 1e3 for r in rows], 0.4,
            label="compose (splice skills)")
    ax1.set_xticks(list(x), names, rotation=20)
    ax1.set_ylabel("time to first token (ms)")
    ax1.set_title("Time to first token")
    ax1.legend(fontsize=8, framealpha=0.9)
    ax2.bar(list(x), [1 - r.logit_cosine for r in rows], color="tab:green")
    ax2.set_yscale("log")
    ax2.set_xticks(list(x), names, rotation=20)
    ax2.set_ylabel("1 - logit cosine (lower is closer)")
    ax2.set_title("Distance from full recompute")
    fig.suptitle(f"kvnotes compose demo: {result.model}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(result: ComposeDemoResult, out: Path,
                 extra_sections: Sequence[str] = ()) -> Path:
    """``results.json``, ``report.md`` and ``compose.png`` in ``out``; returns the report's path."""
    report = report_markdown(result, extra_sections)
    return write_bundle(out, result.to_dict(), report=report, json_name="results.json",
                        plot_name="compose.png", plot=lambda path: plot(result, path))["report"]


def report_markdown(result: ComposeDemoResult, extra_sections: Sequence[str] = ()) -> str:
    """The demo's markdown report (``extra_sections``: more markdown lines at the end)."""
    timing = result.timing
    skills = "\n".join(f"- `{n}`: {s.tokens} tokens, compiled once in {s.compile_s * 1e3:.0f} ms"
                       f" (anchor: {s.anchor}"
                       + (f" + the {s.after_tokens}-token system header)"
                          if s.after_tokens else ")")
                       for n, s in result.skills.items())
    body = [
        f"# kvnotes demo — {result.model}",
        "",
        "The system header and the policies are skills, prefilled once (each policy behind the "
        "system header it follows in every prompt, whose notes are then dropped), then "
        "re-rotated to their place in each prompt and spliced in; a policy not right behind "
        "the header it was compiled behind has its first tokens recomputed in context "
        f"(compose repair `{result.repair}`: `f<tokens>a<alignment>`, `f0a1` is the bare "
        "splice); then the request (the customer's context and the question) is computed, in "
        "one forward. The reference is a full prefill of the "
        "very same token ids. Logit cosine and KL(recompute ‖ compose) are taken "
        "at the first answer token; 'continuation' compares "
        f"{result.max_new_tokens} greedy tokens.",
        "",
        f"Times are medians of {timing.repeats} runs after a warm-up; "
        f"{load_note(timing.machine_after)}." if timing else "",
        "",
        "## Skills",
        skills,
        "",
        "## Compose vs full recompute",
        render_table(result),
        "",
        "![compose](compose.png)",
        "",
        "## Answers (compose)",
        *[f"- **{c.case}**: {c.fidelity.composed_text.strip()!r}" for c in result.cases],
        *extra_sections,
    ]
    return "\n".join(body) + "\n"
