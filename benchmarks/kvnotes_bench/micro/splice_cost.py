"""Splice cost per token on a server's worker, against a plain copy of the same bytes.

What a vLLM worker does for a spliced load (:class:`kvnotes.serving.vllm.kv_writer.KvWriter`):
assemble the load's keys (re-rotated from where the skill was compiled to where it is placed)
and values for every layer, then write them through the attention backend's
``do_kv_cache_update`` into the paged cache. Here the cache is laid out like vLLM-CPU's
(``[blocks, kv_heads, block_size, 2 * head_dim]`` per layer, viewed as keys then values per
block, block size 128, blocks in shuffled order), and the write is a torch copy per run of
consecutive slots into that layout, standing in for vLLM-CPU's C++
``cpu_attn_reshape_and_cache`` (not importable outside vLLM's environment). No server runs.

Three states of the worker's bounded LRU (:class:`~kvnotes.serving.vllm.kv_writer.PieceCache`):
``warm`` (the piece and its keys turned to this offset are cached: slicing, one concatenation
and the cache write), ``turn`` (the piece is cached, its rotation to this offset is not) and
``cold`` (nothing cached: the entry is read from the page cache, checksummed, cut to the
worker's share, staged and rotated). The baseline is ``copy_`` of a buffer holding the same
number of bytes as the load writes into the cache. Per token: median seconds over --reps
(after one warm-up) divided by the load's tokens.

The skill is real: SmolLM2-135M's KV of one 4096-token text compiled by kvnotes' engine (kept
in a serving library under $KVNOTES_HOME, so a rerun skips the compile); each shorter load is
its first n tokens (exactly what compiling those n tokens gives: attention is causal).

    .venv/bin/python -m kvnotes_bench.micro.splice_cost --out docs/results/splice-cost
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from kvnotes.core.engine import Engine
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.machine import load_note, machine_info, set_threads
from kvnotes.core.models import kvnotes_home, load
from kvnotes.core.notebook import Notebook
from kvnotes.serving.library.manifest import read_entry
from kvnotes.serving.library.splice import Placement
from kvnotes.serving.skills import ServingSkills
from kvnotes.serving.vllm.kv_writer import KvWriter, PieceCache, WorkerShare
from kvnotes.serving.vllm.plans import LoadSpec

OFFSET = 37  # where the load is placed: not where it was compiled, so keys are re-rotated
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class SpliceCostConfig:
    """One run: loads of each of ``lengths`` tokens into a ``dtype`` cache of ``block_size``
    blocks, the medians of ``reps`` timed runs after one warm-up, on ``threads`` torch threads
    (None: the machine's physical cores); the long skill is kept in the serving library under
    ``library`` (None: ``$KVNOTES_HOME/bench/splice-cost``)."""

    model: str = "smollm2-135m"
    lengths: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    reps: int = 7
    dtype: str = "float32"
    block_size: int = 128
    threads: int | None = None
    library: Path | None = None

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 1 or self.reps < 1 or self.block_size < 1:
            raise InvalidArgumentError("lengths (tokens), reps and block_size must be at least 1, "
                                       f"got {self.lengths}, {self.reps} and {self.block_size}")
        if self.dtype not in DTYPES:
            raise InvalidArgumentError(f"dtype must be one of {', '.join(DTYPES)}, got "
                                       f"{self.dtype!r}")


@dataclass(frozen=True)
class SpliceCostRow:
    """One load length: seconds per token of the plain copy and of each worker state
    (``copy``, ``warm``, ``turn``, ``cold``), and each state against the copy."""

    tokens: int
    bytes_written: int
    per_token_s: dict[str, float]
    vs_copy: dict[str, float]
    raw_s: dict[str, list[float]]  # every timed run, per state

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpliceCostRow:
        return cls(**{f.name: d[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class SpliceCostResult:
    """What one run measured; :meth:`to_dict` is ``splice_cost.json``'s schema."""

    benchmark: str
    date: str
    command: str
    model: str
    dtype: str
    block_size: int
    offset: int
    reps: int
    warmup: int
    compile_or_reuse_s: float
    torch_threads: int
    load_average_before: list[float]
    load_average_after: list[float]
    machine_before: dict[str, Any]  # kvnotes.core.machine.machine_info records
    machine_after: dict[str, Any]
    busy: bool
    rows: tuple[SpliceCostRow, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rows": [asdict(r) for r in self.rows]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpliceCostResult:
        return cls(**{**{f.name: d[f.name] for f in fields(cls)},
                      "rows": tuple(SpliceCostRow.from_dict(r) for r in d["rows"])})


class CpuCacheWrite:
    """vLLM-CPU's cache layout (each block holds a head's keys, then its values), written one
    run of consecutive slots at a time: the same bytes in the same places as its C++ op, which
    copies each token's head vectors (a torch index write of the same slots is about ten times
    slower here, and would measure torch's indexing instead)."""

    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        blocks, heads, block_size, two_d = kv_cache.shape
        cache = kv_cache.view(blocks, heads, 2 * block_size, two_d // 2)
        b, o = slot_mapping // block_size, slot_mapping % block_size
        breaks = (b[1:] != b[:-1]) | (o[1:] != o[:-1] + 1)
        cuts = (torch.nonzero(breaks).flatten() + 1).tolist()
        bl, ol = b.tolist(), o.tolist()
        for s, e in zip([0, *cuts], [*cuts, len(bl)], strict=True):
            blk, lo, hi = bl[s], ol[s], ol[s] + e - s
            cache[blk, :, lo:hi].copy_(key[s:e].transpose(0, 1))  # [heads, run, head_dim]
            cache[blk, :, block_size + lo:block_size + hi].copy_(value[s:e].transpose(0, 1))


def skill_text(tokens: int, engine: Engine) -> str:
    lines: list[str] = []
    i = 0
    while len(engine.encode("".join(lines))) < tokens + 16:
        lines.append(f"Rule {i}: an order of type {i % 17} shipped to zone {i % 5} may be "
                     f"returned within {10 + i % 50} days for store credit.\n")
        i += 1
    return "".join(lines)


def long_skill(engine: Engine, tokens: int, library: Path) -> Path:
    """The library entry of one compiled skill of at least ``tokens`` tokens (compiled once,
    kept in the serving library at ``library``)."""
    skills = ServingSkills(library, engine)
    info = skills.add(skill_text(tokens, engine), name="rules")
    return skills.folder / f"{info.key}.safetensors"


def median_per_token(fn: Callable[[], None], reps: int, n: int) -> tuple[float, list[float]]:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / n, times


def measure(engine: Engine, entry: Path, n: int, skills: ServingSkills, reps: int,
            dtype: torch.dtype, block_size: int) -> SpliceCostRow:
    folder, manifest = skills.folder, skills.manifest
    path = Notebook.load(entry, engine).slice(0, n).save(folder / f"first-{n}.safetensors")
    info, _, _ = read_entry(path, engine.fingerprint)
    heads, d, layers_n = manifest.num_kv_heads, manifest.head_dim, manifest.num_layers
    blocks = -(-(OFFSET + n) // block_size) + 1
    torch.manual_seed(0)
    block_ids = tuple(int(b) for b in torch.randperm(blocks))
    load = LoadSpec("bench", None, (Placement(info, OFFSET),), OFFSET, OFFSET + n, block_ids,
                    block_size)
    share = WorkerShare(torch.device("cpu"), dtype, range(heads), tuple(range(layers_n)))
    writer = KvWriter(folder, manifest, share)
    impl = CpuCacheWrite()
    layers = [(i, SimpleNamespace(impl=impl, kv_cache=torch.zeros(blocks, heads, block_size,
                                                                  2 * d, dtype=dtype)))
              for i in range(layers_n)]

    def splice() -> None:
        assert writer.write([load], layers) == set()

    def turn() -> None:
        writer.cache.drop((None, "turned", info.key, load.run[0].delta))
        splice()

    def cold() -> None:
        writer.cache = PieceCache(writer.cache.max_bytes)
        splice()

    warm_s, warm_raw = median_per_token(splice, reps, n)
    turn_s, turn_raw = median_per_token(turn, reps, n)
    cold_s, cold_raw = median_per_token(cold, reps, n)
    # the last write put the load's keys and values at its slots (checked on one layer)
    keys, values = writer.assemble(load)
    cache = layers[-1][1].kv_cache.view(blocks, heads, 2 * block_size, d)
    slots = load.slots()
    b, o = slots // block_size, slots % block_size
    if not (torch.equal(cache[b, :, o], keys[-1]) and torch.equal(cache[b, :, block_size + o],
                                                                  values[-1])):
        raise AssertionError(f"n={n}: the cache does not hold the load at its slots")
    nbytes = 2 * layers_n * n * heads * d * torch.empty(0, dtype=dtype).element_size()
    src = torch.randn(nbytes // torch.empty(0, dtype=dtype).element_size()).to(dtype)
    dst = torch.empty_like(src)
    def copy() -> None:
        dst.copy_(src)

    copy_s, copy_raw = median_per_token(copy, reps, n)
    path.unlink()
    return SpliceCostRow(
        tokens=n, bytes_written=nbytes,
        per_token_s={"copy": copy_s, "warm": warm_s, "turn": turn_s, "cold": cold_s},
        vs_copy={"warm": warm_s / copy_s, "turn": turn_s / copy_s, "cold": cold_s / copy_s},
        raw_s={"copy": copy_raw, "warm": warm_raw, "turn": turn_raw, "cold": cold_raw})


def run(config: SpliceCostConfig, engine: Engine | None = None, command: str = "",
        say: Callable[[str], None] = print) -> SpliceCostResult:
    """Every length of ``config`` (``engine``: default ``config.model`` loaded); ``command`` is
    recorded as the run's command line."""
    set_threads(config.threads)
    before = machine_info()
    started = datetime.datetime.now(datetime.UTC)
    engine = load(config.model) if engine is None else engine
    library = kvnotes_home() / "bench" / "splice-cost" if config.library is None else config.library
    t0 = time.perf_counter()
    entry = long_skill(engine, max(config.lengths), library)
    compile_s = time.perf_counter() - t0
    dtype = getattr(torch, config.dtype)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        skills = ServingSkills(tmp, engine)  # a manifest; the loads' entries are written beside it
        for n in config.lengths:
            row = measure(engine, entry, n, skills, config.reps, dtype, config.block_size)
            rows.append(row)
            r = row.per_token_s
            say(f"n={n}: copy {1e6 * r['copy']:.2f} us/token, splice warm "
                f"{1e6 * r['warm']:.2f}, turn {1e6 * r['turn']:.2f}, cold {1e6 * r['cold']:.2f}")
    after = machine_info(since=before)
    return SpliceCostResult(
        benchmark="splice_cost", date=started.isoformat(timespec="seconds"), command=command,
        model=config.model, dtype=config.dtype, block_size=config.block_size, offset=OFFSET,
        reps=config.reps, warmup=1, compile_or_reuse_s=compile_s,
        torch_threads=after["torch_threads"],
        load_average_before=list(before["load_average"]),
        load_average_after=list(after["load_average"]), machine_before=before,
        machine_after=after, busy=before["busy"] or after["busy"], rows=tuple(rows))


def plot(result: SpliceCostResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.rows
    x = [r.tokens for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    labels = {"copy": "plain copy of the same bytes", "warm": "splice, warm (rotation cached)",
              "turn": "splice, piece cached, rotation not", "cold": "splice, cold (read entry)"}
    for key, label in labels.items():
        ax.loglog(x, [1e6 * r.per_token_s[key] for r in rows], "o-", label=label)
    ax.set_xlabel("tokens loaded")
    ax.set_ylabel("microseconds per token (median)")
    busy = ", machine shared" if result.busy else ""
    ax.set_title(f"Worker splice cost ({result.model}, {result.dtype} cache, block "
                 f"{result.block_size}, {result.torch_threads} threads{busy})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="256,512,1024,2048,4096")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dtype", default="float32", choices=DTYPES, help="the served (cache) dtype")
    ap.add_argument("--block-size", type=int, default=128, help="vLLM-CPU's default")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: the machine's physical cores)")
    ap.add_argument("--out", type=Path, default=Path("out/bench/splice-cost"))
    args = ap.parse_args()
    config = SpliceCostConfig(model=args.model,
                              lengths=tuple(int(x) for x in args.lengths.split(",")),
                              reps=args.reps, dtype=args.dtype, block_size=args.block_size,
                              threads=args.threads)
    command = shlex.join([sys.executable, "-m", __spec__.name if __spec__ else __name__,
                          *sys.argv[1:]])
    result = run(config, command=command)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "splice_cost.json").write_text(json.dumps(result.to_dict(), indent=2))
    plot(result, args.out / "splice_cost.png")
    print(load_note(result.machine_after))


if __name__ == "__main__":
    main()
