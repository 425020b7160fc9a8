"""Batched decoding: the edit suite's chains of thought, decoded one notebook at a time or as one
batch (``Engine.continue_greedy_batch``), in wall time per generated token of the whole batch.

The notebooks are those one edit-suite case asks its question on with CoT: the old value, the
recompute and every default strategy's edit (12 notebooks of slightly different lengths: the
erratum appends, so the batch is left-padded). Each side decodes exactly --tokens tokens per
row (end-of-sequence is not allowed to stop a row early, so both sides do the same work); the
texts of both sides are compared. Medians over --reps after one warm-up; the JSON records the
torch threads and the load average. Run on a quiet machine:
    .venv/bin/python -m kvnotes_bench.micro.batch_decode --out out/bench
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from kvnotes.core.engine import Engine
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.machine import MachineInfo, load_note, machine_info, set_threads
from kvnotes.core.models import load
from kvnotes.core.notebook import Notebook
from kvnotes.eval.tasks import load_suite
from kvnotes.ops.edit import edit
from kvnotes.research.edit.cases import case_prompt
from kvnotes.research.edit.strategies import DEFAULT_STRATEGIES, parse_strategy
from kvnotes_bench.kit.plots import panels
from kvnotes_bench.kit.timing import median_time


def case_notebooks(engine: Engine, family: str) -> tuple[list[Notebook], list[int]]:
    """The notebooks one CoT case asks its question on, each with the question fed, and the
    question's ids."""
    case = load_suite([family])[0]
    doc, query = case_prompt(engine, case, cot=True)
    old = engine.prefill(doc)
    notebooks = [old]
    for spec in DEFAULT_STRATEGIES:
        name, options = parse_strategy(spec)
        notebooks.append(edit(engine, old, case.field, case.new_value, strategy=name,
                                     **options)[0])
    return notebooks, engine.encode(query)


@dataclass(frozen=True)
class BatchDecodeConfig:
    """One batched-decoding run: ``tokens`` decoded per row of ``family``'s first case, the
    medians of ``reps`` timed runs after one warm-up, on ``threads`` torch threads (None: the
    machine's physical cores)."""

    model: str = "smollm2-135m"
    family: str = "refund"
    tokens: int = 32
    reps: int = 3
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.reps < 1:
            raise InvalidArgumentError(f"tokens and reps must be at least 1, got {self.tokens} "
                                       f"and {self.reps}")


@dataclass(frozen=True)
class BatchDecodeResult:
    """What one run measured; :meth:`to_dict` is ``batch_decode.json``'s schema."""

    model: str
    family: str
    rows: int
    row_tokens: list[int]
    new_tokens_per_row: int
    one_by_one_s: float
    batched_s: float
    speedup: float
    one_by_one_ms_per_row_token: float
    batched_ms_per_row_token: float
    texts_identical: int
    raw: dict[str, list[float]]  # every timed run, per side
    reps: int
    warmup: int
    dtype: str
    torch_threads: int
    machine_before: MachineInfo  # kvnotes.core.machine.machine_info records
    machine_after: MachineInfo
    busy: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BatchDecodeResult:
        return cls(**{f.name: d[f.name] for f in fields(cls)})


def run(config: BatchDecodeConfig, engine: Engine | None = None) -> BatchDecodeResult:
    """Decode the case's notebooks one at a time and as one batch (``engine``: default
    ``config.model`` loaded; its end-of-sequence ids are cleared so every row decodes exactly
    ``config.tokens`` tokens on both sides)."""
    set_threads(config.threads)
    before = machine_info()
    engine = load(config.model) if engine is None else engine
    engine.eos_ids = set()
    notebooks, q_ids = case_notebooks(engine, config.family)
    steps = [engine.forward(nb, q_ids) for nb in notebooks]
    fed = [s.notebook for s in steps]
    logits = torch.stack([s.logits for s in steps])

    def one_by_one() -> list[str]:
        return [engine.continue_greedy(nb, lg, config.tokens).text
                for nb, lg in zip(fed, logits, strict=True)]

    def batched() -> list[str]:
        return [c.text for c in engine.continue_greedy_batch(fed, logits, config.tokens)]

    seq_s, seq_raw, seq_texts = median_time(one_by_one, config.reps)
    bat_s, bat_raw, bat_texts = median_time(batched, config.reps)
    after = machine_info(since=before)
    b = len(fed)
    return BatchDecodeResult(
        model=config.model, family=config.family, rows=b, row_tokens=[len(nb) for nb in fed],
        new_tokens_per_row=config.tokens, one_by_one_s=seq_s, batched_s=bat_s,
        speedup=seq_s / bat_s,
        one_by_one_ms_per_row_token=1e3 * seq_s / (b * config.tokens),
        batched_ms_per_row_token=1e3 * bat_s / (b * config.tokens),
        texts_identical=sum(a == c for a, c in zip(seq_texts, bat_texts, strict=True)),
        raw={"one_by_one_s": seq_raw, "batched_s": bat_raw}, reps=config.reps, warmup=1,
        dtype=str(engine.dtype), torch_threads=after["torch_threads"], machine_before=before,
        machine_after=after, busy=before["busy"] or after["busy"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--family", default="refund")
    ap.add_argument("--tokens", type=int, default=32, help="tokens decoded per row")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: the machine's physical cores)")
    ap.add_argument("--out", type=Path, default=Path("out/bench"))
    args = ap.parse_args()
    result = run(BatchDecodeConfig(model=args.model, family=args.family, tokens=args.tokens,
                                   reps=args.reps, threads=args.threads))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "batch_decode.json").write_text(json.dumps(result.to_dict(), indent=2))
    plot(result, args.out / "batch_decode.png")
    print(f"{result.rows} rows x {result.new_tokens_per_row} tokens: one by one "
          f"{result.one_by_one_s:.2f} s, batched {result.batched_s:.2f} s "
          f"({result.speedup:.1f}x); texts identical {result.texts_identical}/{result.rows}")
    print(load_note(result.machine_after))


def plot(result: BatchDecodeResult, path: Path) -> None:
    with panels(path, 1, size=(5.5, 4)) as (ax,):
        labels = ["one notebook at a time", "one batch"]
        values = [result.one_by_one_s, result.batched_s]
        ax.bar(labels, values, color=["tab:gray", "tab:green"])
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.2f} s", ha="center", va="bottom")
        ax.set_ylabel("wall time (median)")
        busy = ", machine busy" if result.busy else ""
        ax.set_title(f"CoT decoding of one edit case: {result.rows} notebooks x "
                     f"{result.new_tokens_per_row} tokens\n({result.model}, "
                     f"{result.torch_threads} threads{busy})", fontsize=9)


if __name__ == "__main__":
    main()
