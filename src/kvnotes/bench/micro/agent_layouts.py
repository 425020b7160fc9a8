"""The agent's prompt layouts side by side: what each costs and how faithful its fast path is.

For each skill order (``request``, ``loaded``, ``appended``; see kvnotes.apps.agent.prompt) this
runs agent-bench on the same episodes with the same decision guard and reports, per layout:
the arithmetic of each agent (kvnotes.core.work) and the latency ratio, overall and for the fast
path without the guard's recomputes; the fast decision's margin error against recompute; how
often the guard fired and what it cost; and the flips the fast path alone would have made.
Each layout's full agent-bench bundle is written under ``--out/<order>/``; the comparison goes to
``agent-layouts.json`` and ``agent-layouts.png`` (margin-error CDF, and FLOP vs latency ratios).

Timing figures need a quiet machine: run it alone. The JSON records threads and load per layout.
    .venv/bin/python -m kvnotes.bench.micro.agent_layouts --episodes 10 --out out/agent-layouts
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvnotes.apps.agent import AgentConfig
from kvnotes.apps.agent.config import ORDERS
from kvnotes.bench.agent.run import AgentBenchConfig, run_bench, write_outputs
from kvnotes.bench.agent.summary import BenchSummary, fast_margin_errors
from kvnotes.core.machine import load_note, set_threads
from kvnotes.core.models import load


def summary(order: str, result: BenchSummary) -> dict[str, Any]:
    """One layout's row of ``agent-layouts.json``."""
    comp, guard = result.compute, result.guard
    assert comp is not None and result.fast_margin_error is not None  # run_bench fills them in
    return {
        "order": order, "decisions": result.decisions, "identity": result.identity,
        "fast_flips": guard.would_flip_without if guard else result.flip_count,
        "guard_fired": guard.fired if guard else 0,
        "guard_tokens": guard.tokens if guard else 0,
        "latency_ratio": result.latency.ratio, "fast_latency_ratio": comp.fast_latency_ratio,
        "flop_ratio": comp.flop_ratio, "fast_flop_ratio": comp.fast_flop_ratio,
        "margin_error": result.fast_margin_error.to_dict(),
        "margin_errors": sorted(fast_margin_errors(result.records)),
        "machine": result.machine,
    }


def _prefixed(order: str) -> Callable[[str], None]:
    def say(line: str) -> None:
        print(f"[{order}] {line}")

    return say


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for row in rows:
        errors = row["margin_errors"]
        left.step(errors, [(i + 1) / len(errors) for i in range(len(errors))], where="post",
                  label=f"{row['order']} (max {errors[-1]:.2f})")
    left.set_xlabel("fast decision's margin error vs recompute (log-prob)")
    left.set_ylabel("share of decisions")
    left.grid(True, alpha=0.3)
    left.legend()
    width = 0.2
    x = range(len(rows))
    bars = (("fast_flop_ratio", "fast path, FLOPs"), ("fast_latency_ratio", "fast path, latency"),
            ("flop_ratio", "with the guard, FLOPs"), ("latency_ratio", "with the guard, latency"))
    for k, (key, label) in enumerate(bars):
        right.bar([i + (k - 1.5) * width for i in x], [r[key] for r in rows], width, label=label)
    right.set_xticks(list(x), [r["order"] for r in rows])
    right.set_ylabel("recompute / kvnotes")
    right.grid(True, axis="y", alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--episodes", type=int, default=10)
    parser.add_argument("--guard", type=float, default=1.0)
    parser.add_argument("--orders", default=",".join(ORDERS))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="out/agent-layouts")
    args = parser.parse_args()
    orders = args.orders.split(",")
    for order in orders:
        if order not in ORDERS:
            parser.error(f"unknown order {order!r}; valid orders: {', '.join(ORDERS)}")
    set_threads(args.threads)
    engine = load(args.model)
    out = Path(args.out)
    rows = []
    for order in orders:
        config = AgentBenchConfig(agent=AgentConfig(order=order, guard=args.guard),
                             n_episodes=args.episodes, stale=False)
        result = run_bench(engine, config, progress=_prefixed(order))
        write_outputs(result, out / order)
        rows.append(summary(order, result))
        machine = result.machine or {}  # run_bench records it
        print(f"{order}: identity {result.identity:.1%}, fast flips {rows[-1]['fast_flips']}, "
              f"FLOPs {rows[-1]['fast_flop_ratio']:.1f}x fast / {rows[-1]['flop_ratio']:.1f}x "
              f"guarded, latency {rows[-1]['fast_latency_ratio']:.1f}x / "
              f"{rows[-1]['latency_ratio']:.1f}x; {load_note(machine['after'])}")
    data = {"model": engine.name, "episodes": args.episodes, "guard": args.guard, "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "agent-layouts.json").write_text(json.dumps(data, indent=1))
    plot(rows, out / "agent-layouts.png",
         f"{engine.name}: {args.episodes} episodes x 5 turns, guard tau {args.guard}")
    print(f"wrote {out / 'agent-layouts.json'} and {out / 'agent-layouts.png'}")


if __name__ == "__main__":
    main()
