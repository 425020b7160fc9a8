"""The agent's prompt layouts side by side: what each costs and how faithful its fast path is.

For each skill order (``request``, ``loaded``, ``appended``; see kvnotes.apps.agent.prompt) this
runs agent-bench on the same episodes with the same decision guard and reports, per layout:
the arithmetic of each agent (kvnotes.core.work) and the latency ratio, overall and for the fast
path without the guard's recomputes; the fast decision's margin error against recompute; how
often the guard fired and what it cost; and the flips the fast path alone would have made.
Each layout's full agent-bench bundle is written under ``--out/<order>/``; the comparison goes to
``agent-layouts.json`` and ``agent-layouts.png`` (margin-error CDF, and FLOP vs latency ratios).

Timing figures need a quiet machine: run it alone. The JSON records threads and load per layout.
    .venv/bin/python -m kvnotes_bench.micro.agent_layouts --episodes 10 --out out/agent-layouts
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kvnotes.apps.agent import AgentConfig
from kvnotes.apps.agent.config import ORDERS
from kvnotes.core.engine import Engine
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.machine import load_note, set_threads
from kvnotes.core.models import load
from kvnotes.research.agent.run import AgentBenchConfig, run_bench, write_outputs
from kvnotes.research.agent.summary import BenchSummary, fast_margin_errors


@dataclass(frozen=True)
class AgentLayoutsConfig:
    """One run: agent-bench for each of ``orders`` on ``episodes`` scripted episodes of
    ``turns`` turns, decision guard ``guard``, on ``threads`` torch threads (None: the
    machine's physical cores); ``skill_root``: the skill library (None: the kvnotes home's)."""

    model: str = "smollm2-135m"
    episodes: int = 10
    guard: float = 1.0
    orders: tuple[str, ...] = ORDERS
    turns: int = 5
    threads: int | None = None
    skill_root: Path | None = None

    def __post_init__(self) -> None:
        unknown = [o for o in self.orders if o not in ORDERS]
        if not self.orders or unknown:
            raise InvalidArgumentError(f"unknown or no orders {unknown or list(self.orders)}; "
                                       f"valid orders: {', '.join(ORDERS)}")
        if self.episodes < 1 or self.turns < 1:
            raise InvalidArgumentError(f"episodes and turns must be at least 1, got "
                                       f"{self.episodes} and {self.turns}")


@dataclass(frozen=True)
class LayoutRow:
    """One layout's row of ``agent-layouts.json``: its identity and flips, what the guard did,
    the arithmetic and latency ratios (recompute / kvnotes), the fast decision's margin errors."""

    order: str
    decisions: int
    identity: float
    fast_flips: int
    guard_fired: int
    guard_tokens: int
    latency_ratio: float
    fast_latency_ratio: float
    flop_ratio: float
    fast_flop_ratio: float
    margin_error: dict[str, float]  # median, p90, max, under_0.001
    margin_errors: list[float]  # sorted
    machine: dict[str, Any] | None  # agent-bench's machine record, before and after

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayoutRow:
        return cls(**{f.name: d[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class AgentLayoutsResult:
    """What one run measured; :meth:`to_dict` is ``agent-layouts.json``'s schema."""

    model: str
    episodes: int
    guard: float
    rows: tuple[LayoutRow, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rows": [asdict(r) for r in self.rows]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AgentLayoutsResult:
        return cls(model=d["model"], episodes=d["episodes"], guard=d["guard"],
                   rows=tuple(LayoutRow.from_dict(r) for r in d["rows"]))


def summary(order: str, result: BenchSummary) -> LayoutRow:
    """One layout's row from its agent-bench summary."""
    comp, guard = result.compute, result.guard
    if comp is None or result.fast_margin_error is None:
        raise InvalidArgumentError(f"the {order} summary has no arithmetic or margin error: "
                                   "pass run_bench's own summary, not one read back without them")
    return LayoutRow(
        order=order, decisions=result.decisions, identity=result.identity,
        fast_flips=guard.would_flip_without if guard else result.flip_count,
        guard_fired=guard.fired if guard else 0, guard_tokens=guard.tokens if guard else 0,
        latency_ratio=result.latency.ratio, fast_latency_ratio=comp.fast_latency_ratio,
        flop_ratio=comp.flop_ratio, fast_flop_ratio=comp.fast_flop_ratio,
        margin_error=result.fast_margin_error.to_dict(),
        margin_errors=sorted(fast_margin_errors(result.records)), machine=result.machine)


def prefixed(order: str, say: Callable[[str], None]) -> Callable[[str], None]:
    def said(line: str) -> None:
        say(f"[{order}] {line}")

    return said


def run(config: AgentLayoutsConfig, engine: Engine | None = None,
        say: Callable[[str], None] = print,
        saved: Callable[[str, BenchSummary], None] | None = None) -> AgentLayoutsResult:
    """agent-bench for every order of ``config`` (``engine``: default ``config.model``
    loaded); ``saved`` gets each layout's full agent-bench summary as it is done."""
    set_threads(config.threads)
    engine = load(config.model) if engine is None else engine
    rows: list[LayoutRow] = []
    for order in config.orders:
        bench = AgentBenchConfig(agent=AgentConfig(order=order, guard=config.guard),
                                 n_episodes=config.episodes, turns=config.turns, stale=False,
                                 skill_root=config.skill_root)
        result = run_bench(engine, bench, progress=prefixed(order, say))
        if saved is not None:
            saved(order, result)
        row = summary(order, result)
        rows.append(row)
        machine = result.machine or {}  # run_bench records it
        load_line = load_note(machine["after"]) if "after" in machine else "load not recorded"
        say(f"{order}: identity {result.identity:.1%}, fast flips {row.fast_flips}, FLOPs "
            f"{row.fast_flop_ratio:.1f}x fast / {row.flop_ratio:.1f}x guarded, latency "
            f"{row.fast_latency_ratio:.1f}x / {row.latency_ratio:.1f}x; {load_line}")
    return AgentLayoutsResult(model=engine.name, episodes=config.episodes, guard=config.guard,
                              rows=tuple(rows))


def plot(result: AgentLayoutsResult, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.rows
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for row in rows:
        errors = row.margin_errors
        left.step(errors, [(i + 1) / len(errors) for i in range(len(errors))], where="post",
                  label=f"{row.order} (max {errors[-1]:.2f})")
    left.set_xlabel("fast decision's margin error vs recompute (log-prob)")
    left.set_ylabel("share of decisions")
    left.grid(True, alpha=0.3)
    left.legend()
    width = 0.2
    x = range(len(rows))
    bars = (("fast_flop_ratio", "fast path, FLOPs"), ("fast_latency_ratio", "fast path, latency"),
            ("flop_ratio", "with the guard, FLOPs"), ("latency_ratio", "with the guard, latency"))
    for k, (key, label) in enumerate(bars):
        right.bar([i + (k - 1.5) * width for i in x], [getattr(r, key) for r in rows], width,
                  label=label)
    right.set_xticks(list(x), [r.order for r in rows])
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
    orders = tuple(args.orders.split(","))
    for order in orders:
        if order not in ORDERS:
            parser.error(f"unknown order {order!r}; valid orders: {', '.join(ORDERS)}")
    config = AgentLayoutsConfig(model=args.model, episodes=args.episodes, guard=args.guard,
                                orders=orders, threads=args.threads)
    out = Path(args.out)

    def save(order: str, bench: BenchSummary) -> None:  # each layout's full bundle
        write_outputs(bench, out / order)

    result = run(config, saved=save)
    out.mkdir(parents=True, exist_ok=True)
    (out / "agent-layouts.json").write_text(json.dumps(result.to_dict(), indent=1))
    plot(result, out / "agent-layouts.png",
         f"{result.model}: {result.episodes} episodes x {config.turns} turns, guard tau "
         f"{result.guard}")
    print(f"wrote {out / 'agent-layouts.json'} and {out / 'agent-layouts.png'}")


if __name__ == "__main__":
    main()
