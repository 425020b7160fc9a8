"""Time to first token: full recompute vs compose, as the spliced skill grows.

The prompt is [system header][policy skill of L tokens][request], where the request (a short
customer message and question) is the only new text. Both the header and the policy are
compiled skills; a request is answered by splicing them and feeding the request once.

- recompute: one forward over every token (header + skill + request): what a cache miss costs
- compose:   splice header and skill (re-rotate into the notebook), then one forward over the
             request: the time to first token of a composed request
- alone:     the request's own forward on a near-empty notebook (the header only): what the
             request costs by itself
- splice:    the re-rotation alone (the O(L) part of compose)
- decode:    time per greedy token after the composed request (flat in L when decoding appends
             in place)

Reported per length: ``speedup`` = recompute / compose; ``efficiency`` = alone / compose (1.0
means composing costs nothing beyond the request's own forward); ``ceiling`` = recompute /
alone (the speedup compose would reach at efficiency 1); ``speedup_bound`` = total tokens /
request tokens. Medians over --reps after one warm-up; the JSON records torch threads, the load
average and whether the machine was busy. Writes JSON and a log-log PNG with fitted slopes. Run
on a quiet machine:
    .venv/bin/python benchmarks/compose_ttft.py --out out/bench
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib import resources
from pathlib import Path

import numpy as np
from tqdm import tqdm

import kvnotes
from kvnotes.core.chat import chat_frame
from kvnotes.core.machine import load_note, machine_info, set_threads


def skill_text(engine: kvnotes.Engine, n_tokens: int) -> str:
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


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_time(fn, reps: int) -> tuple[float, list[float]]:
    """One warm-up call, then the median of ``reps`` timed calls (and the raw times)."""
    fn()
    times = [timed(fn) for _ in range(reps)]
    return statistics.median(times), times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", default="256,512,1024,2048,4096")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: the machine's physical cores)")
    ap.add_argument("--out", type=Path, default=Path("out/bench"))
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    set_threads(args.threads)
    before = machine_info()

    engine = kvnotes.load(args.model)
    head, middle, tail = chat_frame(engine.tokenizer)
    header = engine.compile(head + "You are a support agent. Follow the policy below.\n",
                            name="header")
    request = (middle + "Order N-55812: backpack delivered 41 days ago, unused. Card refund "
               "allowed? Answer yes or no." + tail)
    request_ids = engine.encode(request)
    near_empty = engine.compose([header])
    rows = []
    for n in tqdm(lengths, desc="skill lengths"):
        skill = engine.compile(skill_text(engine, n), name="policy")
        parts = [header, skill]
        composed = engine.compose(parts)  # the token ids recompute uses
        ids = composed.token_ids.tolist() + request_ids
        prefix = composed.slice(0, len(composed) - len(skill))
        rec, rec_raw = median_time(lambda ids=ids: engine.next_logits(engine.empty(0), ids),
                                   args.reps)
        comp, comp_raw = median_time(
            lambda p=parts: engine.next_logits(engine.compose(p), request_ids), args.reps)
        alone, alone_raw = median_time(lambda: engine.next_logits(near_empty, request_ids),
                                       args.reps)
        splice, splice_raw = median_time(lambda pre=prefix, sk=skill: pre.splice(sk), args.reps)
        asked = engine.extend(composed, request_ids)
        decode, decode_raw = median_time(
            lambda nb=asked: engine.greedy(nb, None, args.decode_tokens), args.reps)
        per_token = decode / args.decode_tokens
        rows.append({
            "requested_tokens": n, "skill_tokens": len(skill), "total_tokens": len(ids),
            "request_tokens": len(request_ids), "speedup_bound": len(ids) / len(request_ids),
            "recompute_s": rec, "compose_s": comp, "request_alone_s": alone, "splice_s": splice,
            "decode_s_per_token": per_token,
            "speedup": rec / comp, "efficiency": alone / comp, "ceiling": rec / alone,
            "raw": {"recompute_s": rec_raw, "compose_s": comp_raw, "request_alone_s": alone_raw,
                    "splice_s": splice_raw, "decode_s": decode_raw},
        })
        r = rows[-1]
        tqdm.write(f"L={n}: recompute {rec*1e3:.0f} ms, compose {comp*1e3:.0f} ms, request alone "
                   f"{alone*1e3:.0f} ms, splice {splice*1e3:.1f} ms, decode "
                   f"{per_token*1e3:.1f} ms/token; speedup {r['speedup']:.1f}x, efficiency "
                   f"{r['efficiency']:.2f}, ceiling {r['ceiling']:.1f}x")

    def slope(key: str) -> float:
        if len(rows) < 2:
            return float("nan")
        x = np.log([r["skill_tokens"] for r in rows])
        y = np.log([r[key] for r in rows])
        return float(np.polyfit(x, y, 1)[0])

    after = machine_info()
    result = {
        "model": args.model, "reps": args.reps, "warmup": 1, "dtype": str(engine.dtype),
        "torch_threads": after["torch_threads"], "machine": after["machine"],
        "machine_before": before, "machine_after": after,
        "busy": before["busy"] or after["busy"], "rows": rows,
        "slopes": {k: slope(k) for k in ("recompute_s", "compose_s", "splice_s",
                                         "decode_s_per_token")},
    }
    for at in (2048, 4096):
        hit = [r for r in rows if r["requested_tokens"] == at]
        result[f"speedup_at_{at}"] = hit[0]["speedup"] if hit else None
        result[f"efficiency_at_{at}"] = hit[0]["efficiency"] if hit else None
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compose_ttft.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "compose_ttft.png")
    print(json.dumps({k: v for k, v in result.items() if k.startswith(("slopes", "speedup_at",
                                                                        "efficiency_at"))},
                     indent=2))
    print(load_note(after))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    x = [r["skill_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for key, label in (("recompute_s", "full recompute"), ("compose_s", "compose (TTFT)"),
                       ("request_alone_s", "request alone (near-empty notebook)"),
                       ("splice_s", "splice only (re-rotation)"),
                       ("decode_s_per_token", "greedy decode, per token")):
        slope = result["slopes"].get(key, float("nan"))
        ax.loglog(x, [r[key] for r in rows], "o-", label=f"{label}: slope {slope:.2f}")
    ax.set_xlabel("skill tokens L")
    ax.set_ylabel("seconds (median)")
    busy = ", machine busy" if result["busy"] else ""
    ax.set_title(f"Time vs skill length ({result['model']}, CPU, "
                 f"{result['torch_threads']} threads{busy})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
