"""Time to first token: full recompute vs compose, as the spliced skill grows.

The prompt is [system header][policy skill of L tokens][request], where the request (a short
customer message and question) is the only new text. Both the header and the policy are
compiled skills; a request is answered by splicing them and feeding the request once.

- recompute: one forward over every token (header + skill + request): what a cache miss costs
- compose:   splice header and skill (re-rotate into the notebook; a bare splice,
             ``repair=0``), then one forward over the request: the time to first token of a
             composed request
- alone:     the request's own forward on a near-empty notebook (the header only): what the
             request costs by itself
- over_context: the request's forward on top of the already composed notebook: what it costs
             when the context is a perfect prefix-cache hit (its attention over L included)
- splice:    the re-rotation alone (the O(L) part of compose)
- decode:    time per decode step after the composed request: exactly --decode-tokens forwards of
             one token each (no end-of-sequence stop, so every length times the same work)

Reported per length: ``speedup`` = recompute / compose; ``efficiency`` = alone / compose (1.0
means composing costs nothing beyond the request's own forward); ``prefix_hit_efficiency`` =
over_context / compose (1.0 means composing costs no more than a prefix-cache hit of the same
context would); ``ceiling`` = recompute / alone (the speedup compose would reach at efficiency
1); ``speedup_bound`` = total tokens / request tokens.

Two physical floors are written beside the times, from the model's shapes (no timing in them):
``attention_flop_share`` = the share of the request's FLOPs that the context adds
(:meth:`kvnotes.core.work.CostModel.attention_share`; the best ``efficiency`` any implementation
can reach when the forward is compute-bound is ``1 - attention_flop_share``), and
``decode_bytes_ratio`` = bytes a decode step must read (weights + KV at this length) ÷ the same
at the shortest length (what a memory-bound decode step's time grows by). Medians over --reps
after one warm-up; the JSON records torch threads, the load average and whether the machine was
busy. Writes JSON and a log-log PNG with fitted slopes. Run on a quiet machine:
    .venv/bin/python -m kvnotes_bench.micro.compose_ttft --out out/bench
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from kvnotes.core.chat import chat_frame
from kvnotes.core.engine import Engine
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.machine import MachineInfo, load_note, machine_info, set_threads
from kvnotes.core.models import load
from kvnotes.core.notebook import Notebook
from kvnotes_bench.kit.plots import panels
from kvnotes_bench.kit.timing import median_time


def skill_text(engine: Engine, n_tokens: int) -> str:
    """Realistic policy text of about ``n_tokens`` tokens (the demo policies, cycled)."""
    folder = resources.files("kvnotes.apps") / "data" / "demo"
    docs = [p.read_text() for p in sorted(folder.iterdir(), key=lambda p: p.name)
            if p.name.endswith(".txt")]
    ids: list[int] = []
    i = 0
    while len(ids) < n_tokens:
        ids.extend(engine.encode(f"\n\n[Section {i + 1}]\n" + docs[i % len(docs)]))
        i += 1
    return engine.decode(ids[:n_tokens])


def decode_steps(engine: Engine, nb: Notebook, steps: int) -> None:
    """``steps`` decode forwards of one token each on top of ``nb`` (greedy picks, no EOS stop)."""
    logits = nb.last_logits
    if logits is None:
        raise InvalidArgumentError("decode_steps needs a notebook with its last logits (a "
                                   "prefill's or a forward's)")
    for _ in range(steps):
        step = engine.forward(nb, [int(logits.argmax())])
        nb, logits = step.notebook, step.logits


def model_shapes(engine: Engine) -> dict[str, int]:
    config: Any = engine.model.config.get_text_config(decoder=True)  # type: ignore[union-attr,operator]
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {"layers": config.num_hidden_layers, "heads": heads, "head_dim": head_dim,
            "kv_heads": getattr(config, "num_key_value_heads", None) or heads}


def decode_bytes(engine: Engine, length: int) -> int:
    """Bytes one decode step reads at ``length`` cached tokens: every weight once (the output
    head included) plus every layer's keys and values."""
    s = model_shapes(engine)
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv = 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * length * engine.dtype.itemsize
    return weights + kv


@dataclass(frozen=True)
class ComposeTtftConfig:
    """One run: a policy skill of each of ``lengths`` tokens, ``decode_tokens`` decode steps
    after each composed request, the medians of ``reps`` timed runs after one warm-up, on
    ``threads`` torch threads (None: the machine's physical cores)."""

    model: str = "smollm2-135m"
    lengths: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    reps: int = 5
    decode_tokens: int = 16
    threads: int | None = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 1 or self.reps < 1 or self.decode_tokens < 1:
            raise InvalidArgumentError("lengths (tokens), reps and decode_tokens must be at least "
                                       f"1, got {self.lengths}, {self.reps} and "
                                       f"{self.decode_tokens}")


@dataclass(frozen=True)
class TtftRow:
    """One skill length: every timing (median seconds) and the ratios the docstring defines."""

    requested_tokens: int
    skill_tokens: int
    total_tokens: int
    request_tokens: int
    speedup_bound: float
    recompute_s: float
    compose_s: float
    request_alone_s: float
    request_over_context_s: float
    splice_s: float
    decode_s_per_token: float
    decode_tokens: int
    speedup: float
    efficiency: float
    prefix_hit_efficiency: float
    ceiling: float
    attention_flop_share: float
    decode_bytes: int
    raw: dict[str, list[float]]  # every timed run, per timing
    # against the shortest length of the run, set once every length is measured
    decode_bytes_ratio: float | None = None
    decode_time_ratio: float | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TtftRow:
        return cls(**{f.name: d[f.name] for f in fields(cls)})


SLOPED = ("recompute_s", "compose_s", "request_over_context_s", "splice_s", "decode_s_per_token")


@dataclass(frozen=True)
class ComposeTtftResult:
    """What one run measured; :meth:`to_dict` is ``compose_ttft.json``'s schema. ``slopes``: the
    log-log slope of each timing of ``SLOPED`` against the skill's tokens; ``*_at_N``: the row of
    ``N`` requested tokens' figures (None when the run has no such row)."""

    model: str
    reps: int
    warmup: int
    dtype: str
    torch_threads: int
    machine: str
    machine_before: MachineInfo  # kvnotes.core.machine.machine_info records
    machine_after: MachineInfo
    busy: bool
    rows: tuple[TtftRow, ...]
    slopes: dict[str, float]
    speedup_at_2048: float | None
    efficiency_at_2048: float | None
    prefix_hit_efficiency_at_2048: float | None
    efficiency_floor_at_2048: float | None
    speedup_at_4096: float | None
    efficiency_at_4096: float | None
    prefix_hit_efficiency_at_4096: float | None
    efficiency_floor_at_4096: float | None
    decode_time_ratio_last: float | None
    decode_bytes_ratio_last: float | None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rows": [asdict(r) for r in self.rows]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ComposeTtftResult:
        return cls(**{**{f.name: d[f.name] for f in fields(cls)},
                      "rows": tuple(TtftRow.from_dict(r) for r in d["rows"])})

    def headline(self) -> dict[str, Any]:
        """The slopes and the figures at 2048 and 4096 tokens, as printed after a run."""
        return {k: v for k, v in self.to_dict().items() if k.startswith((
            "slopes", "speedup_at", "efficiency_at", "prefix_hit_efficiency_at",
            "efficiency_floor_at", "decode_"))}


def measure_length(engine: Engine, header: Notebook, request_ids: list[int],
                   near_empty: Notebook, n: int, reps: int, decode_tokens: int) -> TtftRow:
    """One skill length's row: recompute, compose, the request alone and over the context,
    the splice and a decode step, each the median of ``reps`` timed calls."""
    skill = engine.compile(skill_text(engine, n), name="policy")
    parts = [header, skill]
    composed = engine.compose(parts, repair=0)  # the token ids recompute uses
    ids = composed.token_ids.tolist() + request_ids
    prefix = composed.slice(0, len(composed) - len(skill))
    rec, rec_raw, _ = median_time(lambda: engine.next_logits(engine.empty(0), ids), reps)
    comp, comp_raw, _ = median_time(
        lambda: engine.next_logits(engine.compose(parts, repair=0), request_ids), reps)
    alone, alone_raw, _ = median_time(lambda: engine.next_logits(near_empty, request_ids), reps)
    over, over_raw, _ = median_time(lambda: engine.next_logits(composed, request_ids), reps)
    splice, splice_raw, _ = median_time(lambda: prefix.splice(skill), reps)
    asked = engine.extend(composed, request_ids)
    decode, decode_raw, _ = median_time(lambda: decode_steps(engine, asked, decode_tokens), reps)
    return TtftRow(
        requested_tokens=n, skill_tokens=len(skill), total_tokens=len(ids),
        request_tokens=len(request_ids), speedup_bound=len(ids) / len(request_ids),
        recompute_s=rec, compose_s=comp, request_alone_s=alone, request_over_context_s=over,
        splice_s=splice, decode_s_per_token=decode / decode_tokens, decode_tokens=decode_tokens,
        speedup=rec / comp, efficiency=alone / comp, prefix_hit_efficiency=over / comp,
        ceiling=rec / alone,
        attention_flop_share=engine.cost.attention_share(len(request_ids), len(composed)),
        decode_bytes=decode_bytes(engine, len(asked)),
        raw={"recompute_s": rec_raw, "compose_s": comp_raw, "request_alone_s": alone_raw,
             "request_over_context_s": over_raw, "splice_s": splice_raw,
             "decode_s": decode_raw})


def slope(rows: list[TtftRow], key: str) -> float:
    """The log-log slope of ``key`` against the skill's tokens (NaN under two rows)."""
    if len(rows) < 2:
        return float("nan")
    x = np.log([r.skill_tokens for r in rows])
    y = np.log([getattr(r, key) for r in rows])
    return float(np.polyfit(x, y, 1)[0])


def run(config: ComposeTtftConfig, engine: Engine | None = None,
        say: Callable[[str], None] = print) -> ComposeTtftResult:
    """Every length of ``config`` (``engine``: default ``config.model`` loaded)."""
    set_threads(config.threads)
    before = machine_info()
    engine = load(config.model, dtype=config.dtype) if engine is None else engine
    head, middle, tail = chat_frame(engine.tokenizer)
    header = engine.compile(head + "You are a support agent. Follow the policy below.\n",
                            name="header")
    request = (middle + "Order N-55812: backpack delivered 41 days ago, unused. Card refund "
               "allowed? Answer yes or no." + tail)
    request_ids = engine.encode(request)
    near_empty = engine.compose([header], repair=0)
    rows: list[TtftRow] = []
    for n in config.lengths:
        r = measure_length(engine, header, request_ids, near_empty, n, config.reps,
                           config.decode_tokens)
        rows.append(r)
        say(f"L={n}: recompute {r.recompute_s*1e3:.0f} ms, compose {r.compose_s*1e3:.0f} ms, "
            f"request alone {r.request_alone_s*1e3:.0f} ms, over context "
            f"{r.request_over_context_s*1e3:.0f} ms, splice {r.splice_s*1e3:.1f} ms, decode "
            f"{r.decode_s_per_token*1e3:.1f} ms/token; speedup {r.speedup:.1f}x, efficiency "
            f"{r.efficiency:.2f}, ceiling {r.ceiling:.1f}x")
    first = rows[0]
    rows = [replace(r, decode_bytes_ratio=r.decode_bytes / first.decode_bytes,
                    decode_time_ratio=r.decode_s_per_token / first.decode_s_per_token)
            for r in rows]
    after = machine_info(since=before)
    h2, h4 = (next((r for r in rows if r.requested_tokens == n), None) for n in (2048, 4096))
    return ComposeTtftResult(
        model=config.model, reps=config.reps, warmup=1, dtype=str(engine.dtype),
        torch_threads=after["torch_threads"], machine=after["machine"], machine_before=before,
        machine_after=after, busy=before["busy"] or after["busy"], rows=tuple(rows),
        slopes={k: slope(rows, k) for k in SLOPED},
        speedup_at_2048=h2.speedup if h2 else None,
        efficiency_at_2048=h2.efficiency if h2 else None,
        prefix_hit_efficiency_at_2048=h2.prefix_hit_efficiency if h2 else None,
        efficiency_floor_at_2048=1 - h2.attention_flop_share if h2 else None,
        speedup_at_4096=h4.speedup if h4 else None,
        efficiency_at_4096=h4.efficiency if h4 else None,
        prefix_hit_efficiency_at_4096=h4.prefix_hit_efficiency if h4 else None,
        efficiency_floor_at_4096=1 - h4.attention_flop_share if h4 else None,
        decode_time_ratio_last=rows[-1].decode_time_ratio,
        decode_bytes_ratio_last=rows[-1].decode_bytes_ratio)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="256,512,1024,2048,4096")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: the machine's physical cores)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the model's dtype (bfloat16 only where the CPU has it natively)")
    ap.add_argument("--out", type=Path, default=Path("out/bench"))
    args = ap.parse_args()
    result = run(ComposeTtftConfig(
        model=args.model, lengths=tuple(int(x) for x in args.lengths.split(",")),
        reps=args.reps, decode_tokens=args.decode_tokens, threads=args.threads,
        dtype=args.dtype))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compose_ttft.json").write_text(json.dumps(result.to_dict(), indent=2))
    plot(result, args.out / "compose_ttft.png")
    print(json.dumps(result.headline(), indent=2))
    print(load_note(result.machine_after))


def plot(result: ComposeTtftResult, path: Path) -> None:
    rows = result.rows
    x = [r.skill_tokens for r in rows]
    with panels(path, 1, size=(6.5, 4.5)) as (ax,):
        for key, label in (("recompute_s", "full recompute"), ("compose_s", "compose (TTFT)"),
                           ("request_alone_s", "request alone (near-empty notebook)"),
                           ("request_over_context_s", "request over the context (prefix hit)"),
                           ("splice_s", "splice only (re-rotation)"),
                           ("decode_s_per_token", "greedy decode, per token")):
            fitted = result.slopes.get(key, float("nan"))
            ax.loglog(x, [getattr(r, key) for r in rows], "o-", label=f"{label}: slope {fitted:.2f}")
        ax.set_xlabel("skill tokens L")
        ax.set_ylabel("seconds (median)")
        busy = ", machine busy" if result.busy else ""
        ax.set_title(f"Time vs skill length ({result.model}, CPU, "
                     f"{result.torch_threads} threads{busy})", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()


if __name__ == "__main__":
    main()
