"""Prefix caching's p90 TTFT over each spliced policy's, by skills per prompt: the table and
plot of docs/results.md's "Phases against the 5x goal", from the
skills-front-phases-k{K}-smollm2 bundles of `kvnotes-bench serve skills` (airline prompts,
K skills each, through kvnotes' OpenAI front). Run from the repository root:

    python benchmarks/serve_phases/summary.py docs/results/serve-bench/skills-front-phases-k*-smollm2 \
        --out docs/results/phases-curve

Writes phases-curve.json (per bundle, policy and concurrency: p50/p90 TTFT, the ratio to
prefix, phases per request) and phases-curve.png, and prints the markdown table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

POLICIES = ("compose", "repaired", "guarded", "variants", "variants-guarded")
GOAL = 5.0


def read_skills_run(folder: Path) -> dict[str, Any]:
    """A `serve-bench skills` bundle's results.json; ValueError naming what is wrong."""
    path = folder / "results.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: cannot be read as JSON ({err})") from err
    if not isinstance(data, dict) or data.get("workload") != "skills":
        raise ValueError(f"{path}: not a `kvnotes-bench serve skills` result")
    return data


def rows(folder: Path) -> list[dict[str, Any]]:
    data = read_skills_run(folder)
    k = data["config"]["k"]
    phases = {(p["policy"], p["concurrency"]): p["phases_per_request"] for p in data["phased"]}
    by = {(s["policy"], s["concurrency"]): s for s in data["summaries"]}
    out = []
    for (policy, conc), s in sorted(by.items(), key=lambda x: (x[0][1], x[0][0])):
        prefix = by.get(("prefix", conc))
        if prefix is None:
            continue
        out.append({"bundle": folder.name, "k": k, "policy": policy, "concurrency": conc,
                    "prompt_tokens": s["mean_prompt_tokens"],
                    "p50_s": s["ttft_p50_s"], "p90_s": s["ttft_p90_s"],
                    "prefix_over_this_p90": prefix["ttft_p90_s"] / s["ttft_p90_s"],
                    "prefix_over_this_p50": prefix["ttft_p50_s"] / s["ttft_p50_s"],
                    "phases": 0.0 if policy == "compose" else phases.get((policy, conc)),
                    "load_before": s["load_before"], "started": data["started"],
                    "command": data["command"]})
    return out


def table(all_rows: list[dict[str, Any]]) -> str:
    lines = ["| skills / prompt (tokens) | policy | phases / request | p90 c1 | prefix / this c1 | "
             "p90 c4 | prefix / this c4 |", "|---|---|---:|---:|---:|---:|---:|"]
    keyed = {(r["k"], r["policy"], r["concurrency"]): r for r in all_rows}
    for k in sorted({r["k"] for r in all_rows}):
        for policy in ("prefix", *POLICIES):
            one, four = keyed.get((k, policy, 1)), keyed.get((k, policy, 4))
            if one is None:
                continue
            ph = "-" if one["phases"] is None else f"{one['phases']:.2f}"
            c4 = (f"{four['p90_s']:.3f} s | {four['prefix_over_this_p90']:.1f}x" if four
                  else "- | -")
            lines.append(f"| {k} ({one['prompt_tokens']:.0f}) | {policy} | {ph} | "
                         f"{one['p90_s']:.3f} s | {one['prefix_over_this_p90']:.1f}x | {c4} |")
    return "\n".join(lines) + "\n"


def plot(all_rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, conc in zip(axes, (1, 4), strict=True):
        for policy in POLICIES:
            pts = sorted((r["prompt_tokens"], r["prefix_over_this_p90"], r["phases"])
                         for r in all_rows if r["policy"] == policy and r["concurrency"] == conc)
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=policy)
            for x, y, ph in pts:
                if ph is not None and policy != "compose":
                    ax.annotate(f"{ph:.0f}", (x, y), textcoords="offset points", xytext=(4, 3),
                                fontsize=7)
        ax.axhline(GOAL, color="grey", ls="--", lw=0.8)
        ax.set_title(f"concurrency {conc}", fontsize=9)
        ax.set_xlabel("prompt tokens (2, 4, 8 airline skills)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("p90 TTFT: prefix caching / policy")
    axes[0].legend(fontsize=8)
    fig.suptitle("SmolLM2 through kvnotes' front: how far below prefix caching each policy's p90 "
                 "TTFT is (numbers: phases per request; dashed: the 5x goal)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundles", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    try:
        all_rows = [r for folder in args.bundles for r in rows(folder)]
    except ValueError as err:
        parser.error(str(err))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "phases-curve.json").write_text(json.dumps(all_rows, indent=1) + "\n",
                                                encoding="utf-8")
    plot(all_rows, args.out / "phases-curve.png")
    print(table(all_rows), end="")


if __name__ == "__main__":
    main()
