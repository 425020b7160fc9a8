"""Splice throughput: re-rotating a skill's keys and copying its values into a notebook, in GB/s,
against a plain tensor copy of the same bytes.

A splice writes the re-rotated keys and the values of a compiled skill straight into the
destination notebook's storage (``Notebook.splice``). Its floor is a memory copy of the same
bytes: ``copy_`` of every layer's keys and values into buffers of the same shape. Both run into
warm (already touched) buffers; GB/s counts the skill's KV bytes once. The skill's KV is random
data of the model's exact shapes (the content does not change the work). Medians over --reps
after one warm-up; the JSON records threads, load average and whether the machine was busy.
Run on a quiet machine:
    .venv/bin/python -m kvnotes_bench.micro.splice_bandwidth --out out/bench
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from kvnotes.core.engine import Engine
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.machine import MachineInfo, load_note, machine_info, set_threads
from kvnotes.core.models import load
from kvnotes.core.notebook import LayerKV, Notebook
from kvnotes_bench.kit.plots import panels
from kvnotes_bench.kit.timing import median_time


def random_skill(engine: Engine, n: int) -> Notebook:
    """A notebook of ``n`` tokens with random KV in the model's per-layer shapes."""
    probe = engine.prefill([0])  # one token tells each layer's KV shape
    torch.manual_seed(0)
    layers = [LayerKV(torch.randn(*layer.keys.shape[:-2], n, layer.keys.shape[-1],
                                  dtype=layer.keys.dtype),
                      torch.randn(*layer.values.shape[:-2], n, layer.values.shape[-1],
                                  dtype=layer.values.dtype))
              for layer in probe.layers]
    return Notebook(layers, torch.zeros(n, dtype=torch.long), torch.arange(n), [],
                    engine.adapter, engine.fingerprint)


@dataclass(frozen=True)
class SpliceBandwidthConfig:
    """One splice-throughput run: a random skill of each of ``lengths`` tokens moved to
    ``offset``, the medians of ``reps`` timed runs after one warm-up, on ``threads`` torch
    threads (None: the machine's physical cores)."""

    model: str = "smollm2-135m"
    lengths: tuple[int, ...] = (256, 1024, 4096)
    reps: int = 9
    offset: int = 37
    threads: int | None = None

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 1 or self.reps < 1:
            raise InvalidArgumentError("lengths (tokens) and reps must be at least 1, got "
                                       f"{self.lengths} and {self.reps}")


@dataclass(frozen=True)
class BandwidthRow:
    """One skill length: the splice against a plain copy of the same bytes."""

    tokens: int
    bytes: int
    splice_s: float
    copy_s: float
    splice_gb_s: float
    copy_gb_s: float
    splice_vs_copy: float
    raw: dict[str, list[float]]  # every timed run, per side

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BandwidthRow:
        return cls(**{f.name: d[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class SpliceBandwidthResult:
    """What one run measured; :meth:`to_dict` is ``splice_bandwidth.json``'s schema."""

    model: str
    reps: int
    warmup: int
    dtype: str
    torch_threads: int
    machine_before: MachineInfo  # kvnotes.core.machine.machine_info records
    machine_after: MachineInfo
    busy: bool
    rows: tuple[BandwidthRow, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rows": [asdict(r) for r in self.rows]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpliceBandwidthResult:
        return cls(**{**{f.name: d[f.name] for f in fields(cls)},
                      "rows": tuple(BandwidthRow.from_dict(r) for r in d["rows"])})


def measure(engine: Engine, n: int, reps: int, offset: int) -> BandwidthRow:
    """Splice and plain-copy throughput for a random skill of ``n`` tokens."""
    skill = random_skill(engine, n)
    dest = engine.empty(offset, capacity=n)
    store = dest.storage

    def splice() -> None:
        dest.splice(skill)
        store.release(0, n)  # hand the range back: the next splice writes the same warm buffers

    splice_s, splice_raw, _ = median_time(splice, reps)
    layers = skill.layers
    targets = [(torch.empty_like(l.keys), torch.empty_like(l.values)) for l in layers]

    def copy() -> None:
        for layer, (k, v) in zip(layers, targets, strict=True):
            k.copy_(layer.keys)
            v.copy_(layer.values)

    copy_s, copy_raw, _ = median_time(copy, reps)
    nbytes = skill.nbytes
    return BandwidthRow(tokens=n, bytes=nbytes, splice_s=splice_s, copy_s=copy_s,
                        splice_gb_s=nbytes / splice_s / 1e9, copy_gb_s=nbytes / copy_s / 1e9,
                        splice_vs_copy=copy_s / splice_s,
                        raw={"splice_s": splice_raw, "copy_s": copy_raw})


def run(config: SpliceBandwidthConfig, engine: Engine | None = None,
        say: Callable[[str], None] = print) -> SpliceBandwidthResult:
    """Every length of ``config`` (``engine``: default ``config.model`` loaded)."""
    set_threads(config.threads)
    before = machine_info()
    engine = load(config.model) if engine is None else engine
    rows = []
    for n in config.lengths:
        r = measure(engine, n, config.reps, config.offset)
        rows.append(r)
        say(f"L={n}: splice {r.splice_gb_s:.2f} GB/s, copy {r.copy_gb_s:.2f} GB/s "
            f"({r.splice_vs_copy:.0%} of copy)")
    after = machine_info(since=before)
    return SpliceBandwidthResult(model=config.model, reps=config.reps, warmup=1,
                                 dtype=str(engine.dtype), torch_threads=after["torch_threads"],
                                 machine_before=before, machine_after=after,
                                 busy=before["busy"] or after["busy"], rows=tuple(rows))


def plot(result: SpliceBandwidthResult, path: Path) -> None:
    rows = result.rows
    x = [r.tokens for r in rows]
    with panels(path, 1, size=(6.5, 4.5)) as (ax,):
        ax.semilogx(x, [r.copy_gb_s for r in rows], "o-", label="plain copy of the same bytes")
        ax.semilogx(x, [r.splice_gb_s for r in rows], "o-", label="splice (re-rotate keys + copy values)")
        ax.set_xlabel("skill tokens")
        ax.set_ylabel("GB/s (skill KV bytes / median time)")
        busy = ", machine busy" if result.busy else ""
        ax.set_title(f"Splice throughput ({result.model}, {result.torch_threads} threads{busy})",
                     fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="256,1024,4096")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--offset", type=int, default=37, help="position the skill is moved to")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: the machine's physical cores)")
    ap.add_argument("--out", type=Path, default=Path("out/bench"))
    args = ap.parse_args()
    result = run(SpliceBandwidthConfig(
        model=args.model, lengths=tuple(int(x) for x in args.lengths.split(",")),
        reps=args.reps, offset=args.offset, threads=args.threads))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "splice_bandwidth.json").write_text(json.dumps(result.to_dict(), indent=2))
    plot(result, args.out / "splice_bandwidth.png")
    print(load_note(result.machine_after))


if __name__ == "__main__":
    main()
