"""Splice throughput: re-rotating a skill's keys and copying its values into a notebook, in GB/s,
against a plain tensor copy of the same bytes.

A splice writes the re-rotated keys and the values of a compiled skill straight into the
destination notebook's storage (``Notebook.splice``). Its floor is a memory copy of the same
bytes: ``copy_`` of every layer's keys and values into buffers of the same shape. Both run into
warm (already touched) buffers; GB/s counts the skill's KV bytes once. The skill's KV is random
data of the model's exact shapes (the content does not change the work). Medians over --reps
after one warm-up; the JSON records threads, load average and whether the machine was busy.
Run on a quiet machine:
    .venv/bin/python -m kvnotes.bench.micro.splice_bandwidth --out out/bench
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvnotes.core.engine import Engine
from kvnotes.core.machine import load_note, machine_info, set_threads
from kvnotes.core.models import load
from kvnotes.core.notebook import LayerKV, Notebook


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


def median_time(fn, reps: int) -> tuple[float, list[float]]:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def measure(engine: Engine, n: int, reps: int, offset: int) -> dict:
    skill = random_skill(engine, n)
    dest = engine.empty(offset, capacity=n)
    store = dest.storage

    def splice() -> None:
        dest.splice(skill)
        store.release(0, n)  # hand the range back: the next splice writes the same warm buffers

    splice_s, splice_raw = median_time(splice, reps)
    layers = skill.layers
    targets = [(torch.empty_like(l.keys), torch.empty_like(l.values)) for l in layers]

    def copy() -> None:
        for layer, (k, v) in zip(layers, targets, strict=True):
            k.copy_(layer.keys)
            v.copy_(layer.values)

    copy_s, copy_raw = median_time(copy, reps)
    nbytes = skill.nbytes
    return {"tokens": n, "bytes": nbytes, "splice_s": splice_s, "copy_s": copy_s,
            "splice_gb_s": nbytes / splice_s / 1e9, "copy_gb_s": nbytes / copy_s / 1e9,
            "splice_vs_copy": copy_s / splice_s,
            "raw": {"splice_s": splice_raw, "copy_s": copy_raw}}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    x = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.semilogx(x, [r["copy_gb_s"] for r in rows], "o-", label="plain copy of the same bytes")
    ax.semilogx(x, [r["splice_gb_s"] for r in rows], "o-", label="splice (re-rotate keys + copy values)")
    ax.set_xlabel("skill tokens")
    ax.set_ylabel("GB/s (skill KV bytes / median time)")
    busy = ", machine busy" if result["busy"] else ""
    ax.set_title(f"Splice throughput ({result['model']}, {result['torch_threads']} threads{busy})",
                 fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    set_threads(args.threads)
    before = machine_info()
    engine = load(args.model)
    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        rows.append(measure(engine, n, args.reps, args.offset))
        r = rows[-1]
        print(f"L={n}: splice {r['splice_gb_s']:.2f} GB/s, copy {r['copy_gb_s']:.2f} GB/s "
              f"({r['splice_vs_copy']:.0%} of copy)")
    after = machine_info(since=before)
    result = {"model": args.model, "reps": args.reps, "warmup": 1, "dtype": str(engine.dtype),
              "torch_threads": after["torch_threads"], "machine_before": before,
              "machine_after": after, "busy": before["busy"] or after["busy"], "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "splice_bandwidth.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "splice_bandwidth.png")
    print(load_note(after))


if __name__ == "__main__":
    main()
