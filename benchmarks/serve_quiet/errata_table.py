"""The table of docs/results.md's errata-form comparison, from the errata-{form}-b32 rows of
erratum_rows.py: per form and context, how many answers name the current value, by edit, and how
many name an earlier correction's value or the original one. Run from the repository root:
`python benchmarks/serve_quiet/errata_table.py [RESULTS_DIR]` (docs/results.md's table came from
`python benchmarks/serve_quiet/errata_table.py docs/results/serve-bench`)."""
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(sys.argv[1] if len(sys.argv) > 1 else "out/serve-bench")
FORMS = ("append", "latest", "follow-up", "follow-up-latest")

print("| errata form | context | current value | after edit 1 / 2 / 3 | an earlier correction's "
      "value | the original value | unparsed | TTFT p50 |")
print("|---|---:|---:|---|---:|---:|---:|---:|")
for form in FORMS:
    data = json.loads((ROOT / f"errata-{form}-b32" / "result.json").read_text())
    edits = {s["session"]: s["edits"] for s in data["sessions"]}
    rows: dict[int, dict] = defaultdict(lambda: defaultdict(int))
    for r in data["requests"]:
        if not r["ok"]:
            continue
        row = rows[r["context_tokens"]]
        seen = edits[r["session"]][:r["turn"]]  # the values of earlier corrections
        row["n"] += 1
        row[f"n{r['turn']}"] += 1
        if r["decision"] == r["expected"]:
            row["right"] += 1
            row[f"right{r['turn']}"] += 1
        elif r["decision"] in seen:
            row["earlier"] += 1
        elif r["decision"] == r["stale"]:
            row["original"] += 1
        elif r["decision"] is None:
            row["unparsed"] += 1
    p50 = {s["context_tokens"]: s["ttft_p50_s"] for s in data["summaries"]}
    for ctx in sorted(rows):
        c = rows[ctx]
        by_edit = " / ".join(f"{c[f'right{t}']}/{c[f'n{t}']}" for t in range(3))
        print(f"| {form} | {ctx} | {c['right']}/{c['n']} | {by_edit} | {c['earlier']}/{c['n']} "
              f"| {c['original']}/{c['n']} | {c['unparsed']}/{c['n']} | {p50[ctx]:.3f} s |")
