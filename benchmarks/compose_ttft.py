"""Time to first token: full recompute vs compose, as the spliced skill grows.

The prompt is [system header][policy skill of L tokens][request], where the request (a short
customer message and question) is the only new text. Both the header and the policy are
compiled skills; a request is answered by splicing them and feeding the request once.

- recompute: one forward over every token (header + skill + request): what a cache miss costs
- compose:   splice header and skill (re-rotate + concat), then one forward over the request
- splice:    the re-rotation + concat alone (the O(L) part of compose)

Compose can never beat ``total tokens / request tokens`` (its forward computes the request),
which the JSON reports as ``speedup_bound``. Writes results JSON and a log-log PNG with fitted
slopes (medians over --reps). Run:
    .venv/bin/python benchmarks/compose_ttft.py --out out/bench
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import kvnotes
from kvnotes.core.chat import chat_frame
from kvnotes.core.notebook import Notebook


def skill_text(engine: kvnotes.Engine, n_tokens: int) -> str:
    """Realistic policy text of about ``n_tokens`` tokens (the demo policies, cycled)."""
    folder = resources.files("kvnotes") / "data" / "demo"
    docs = [p.read_text() for p in sorted(folder.iterdir(), key=lambda p: p.name)
            if p.name.endswith(".txt")]
    ids: list[int] = []
    i = 0
    while len(ids) < n_tokens:
        ids.extend(engine.encode(f"\n\n[Section {i + 1}]\n" + docs[i % len(docs)]))
        i += 1
    return engine.decode(ids[:n_tokens])


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="256,512,1024,2048,4096")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("out/bench"))
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]

    engine = kvnotes.load(args.model)
    head, middle, tail = chat_frame(engine.tokenizer)
    header = engine.compile(head + "You are a support agent. Follow the policy below.\n",
                            name="header")
    request = (middle + "Order N-55812: backpack delivered 41 days ago, unused. Card refund "
               "allowed? Answer yes or no." + tail)
    request_ids = engine.encode(request)
    rows = []
    for n in tqdm(lengths, desc="skill lengths"):
        skill = engine.compile(skill_text(engine, n), name="policy")
        parts = [header, skill]
        composed = engine.compose(parts)  # warm-up, and the token ids recompute uses
        ids = composed.token_ids.tolist() + request_ids
        start = len(composed) - len(skill)
        rec, comp, splice = [], [], []
        for _ in range(args.reps):
            rec.append(timed(lambda ids=ids: engine.next_logits(engine.empty(0), ids)))
            comp.append(timed(lambda p=parts: engine.next_logits(engine.compose(p), request_ids)))
            prefix = composed.slice(0, start)
            splice.append(timed(lambda pre=prefix, sk=skill, at=start:
                                Notebook.concat([pre, sk.moved_to(at)])))
        rows.append({
            "requested_tokens": n, "skill_tokens": len(skill), "total_tokens": len(ids),
            "request_tokens": len(request_ids), "speedup_bound": len(ids) / len(request_ids),
            "recompute_s": statistics.median(rec), "compose_s": statistics.median(comp),
            "splice_s": statistics.median(splice),
            "speedup": statistics.median(rec) / statistics.median(comp),
            "raw": {"recompute_s": rec, "compose_s": comp, "splice_s": splice},
        })
        tqdm.write(f"L={n}: recompute {rows[-1]['recompute_s']*1e3:.0f} ms, compose "
                   f"{rows[-1]['compose_s']*1e3:.0f} ms, splice {rows[-1]['splice_s']*1e3:.1f} ms, "
                   f"speedup {rows[-1]['speedup']:.1f}x")

    def slope(key: str) -> float:
        x = np.log([r["skill_tokens"] for r in rows])
        y = np.log([r[key] for r in rows])
        return float(np.polyfit(x, y, 1)[0])

    result = {
        "model": args.model, "reps": args.reps, "torch_threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} / {platform.processor() or 'cpu'}",
        "dtype": str(engine.dtype), "rows": rows,
        "slopes": {k: slope(k) for k in ("recompute_s", "compose_s", "splice_s")},
    }
    at_2048 = [r for r in rows if r["requested_tokens"] == 2048]
    result["speedup_at_2048"] = at_2048[0]["speedup"] if at_2048 else None
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compose_ttft.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "compose_ttft.png")
    print(json.dumps({k: result[k] for k in ("slopes", "speedup_at_2048")}, indent=2))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    x = [r["skill_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for key, label in (("recompute_s", "full recompute"), ("compose_s", "compose (TTFT)"),
                       ("splice_s", "splice only (re-rotate + concat)")):
        ax.loglog(x, [r[key] for r in rows], "o-",
                  label=f"{label}: slope {result['slopes'][key]:.2f}")
    ax.set_xlabel("skill tokens L")
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"Time to first token vs skill length ({result['model']}, CPU)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
