"""The compact table of the repair-sizing runs: bundles of one model and set merged, per strategy.

Usage: ``python benchmarks/repair_sizing/summary.py BUNDLE...`` (folders ``run.py`` wrote). Per
model, set and strategy: cases, tool choice identical to exact, 16-token greedy identical, the
median KL at the decision, the recompute of spliced tokens (mean over cases, exact placements
counted as spliced, as ``bench tools`` reports it), and for the adaptive rule the extra tokens
and forwards per case (``adapt.jsonl``). No timings: the runs shared a 2-core machine.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

SHORT = {"smollm2-135m": "SmolLM2", "gemma3-270m": "Gemma"}


def _rows(folders: list[Path]) -> dict[tuple[str, str], dict[str, list[dict[str, Any]]]]:
    """(model, set) -> strategy -> one dict per case (its outcome, plus its adapt record)."""
    out: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = defaultdict(
        lambda: defaultdict(list))
    for folder in folders:
        result = json.loads((folder / "results.json").read_text(encoding="utf-8"))
        adapt = {}
        path = folder / "adapt.jsonl"
        if path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    rec = json.loads(line)
                    adapt[rec["case"]] = rec["strategies"]
        key = (result["model"], result["set"])
        for case in result["cases"]:
            for o in case["outcomes"]:
                extra = adapt.get(case["id"], {}).get(o["strategy"], {}).get("adapt")
                out[key][o["strategy"]].append({**o, "adapt": extra})
    return out


def table(folders: list[Path]) -> str:
    lines = ["| model | set | strategy | choice identical | 16-token greedy identical | KL "
             "median | recompute of spliced | extra tokens / forwards per case |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for (model, set_name), strategies in _rows(folders).items():
        for name, outs in strategies.items():
            if name == "exact":
                continue
            n = len(outs)
            same = sum(o["identical"] for o in outs)
            greedy = sum(bool(o["greedy_identical"]) for o in outs)
            kl = statistics.median(o["kl"] for o in outs)
            share = statistics.fmean(o["recompute_share"] for o in outs)
            extra = "-"
            adapts = [o["adapt"] for o in outs if o["adapt"]]
            if adapts:
                extra = (f"{statistics.fmean(a['extra_tokens'] for a in adapts):.0f} / "
                         f"{statistics.fmean(a['extra_forwards'] for a in adapts):.1f}")
            lines.append(f"| {SHORT.get(model, model)} | {set_name} | {name} | {same}/{n} "
                         f"({100 * same / n:.0f}%) | {greedy}/{n} ({100 * greedy / n:.0f}%) | "
                         f"{kl:.3f} | {share:.3f} | {extra} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table([Path(p) for p in sys.argv[1:]]))
