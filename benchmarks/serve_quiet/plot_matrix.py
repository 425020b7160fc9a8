"""One TTFT CDF figure for the whole quiet matrix (block 32): every context, policy and
concurrency, read from the result.json files of erratum_rows.py's matrix-b32-* rows in
docs/results/serve-bench/. `python benchmarks/serve_quiet/plot_matrix.py` (from the repository
root) wrote docs/results/serve-bench/matrix-b32-cdf.png."""
import json
from pathlib import Path

from kvnotes_bench.serving.report import plot_ttft_cdf

ROOT = Path("docs/results/serve-bench")
RUNS = ["matrix-b32-c1", "matrix-b32-c4-1k4k", "matrix-b32-c4-8k", "matrix-b32-c16-1k4k",
        "matrix-b32-c16", "matrix-b32-c16-8k"]
requests = []
for run in RUNS:
    data = json.loads((ROOT / run / "result.json").read_text())
    requests += [r for r in data["requests"] if not r.get("skipped")]
merged = {
    "contexts": sorted({r["context_tokens"] for r in requests}),
    "config": {"concurrency": sorted({r["concurrency"] for r in requests}),
               "policies": ["in-place", "erratum", "cold"]},
    "requests": requests,
}
plot_ttft_cdf(merged, ROOT / "matrix-b32-cdf.png")
print(f"{len(requests)} requests from {len(RUNS)} runs -> {ROOT / 'matrix-b32-cdf.png'}")
