"""Does the served model read the erratum? serve-bench with --question status (the order's
current status, i.e. the field's value itself) on one block-32 server: in-place and erratum at
1k and 4k, the erratum alone at 8k (in-place at 8k costs ~40 s a request and states the new value
outright). An accuracy run: its answers are the result; it ran beside other work, so its TTFT
columns are not quiet timings. Run from the repository root."""
from block32_runner import run_configs

RUNS = [
    ("status-b32-1k4k", dict(context_tokens=(1000, 4000), policies=("in-place", "erratum"))),
    ("status-b32-8k", dict(context_tokens=(8000,), policies=("erratum",))),
]
HOW = ("benchmarks/serve_quiet/serve_status.py: --question status, one block-32 server, "
       "accuracy run (not quiet)")
run_configs(RUNS, server_dir="server-status", kv_cache_gib=4, how=HOW, concurrency=(1,),
            sessions=4, edits=4, question="status", max_tokens=24)
