"""Does the served model read the erratum? serve-bench with --question status (the order's
current status, i.e. the field's value itself) on one block-32 server: in-place and erratum at
1k and 4k, the erratum alone at 8k (in-place at 8k costs ~40 s a request and states the new value
outright). An accuracy run: its answers are the result; it ran beside other work, so its TTFT
columns are not quiet timings. Run from the repository root."""
import os
import time
from pathlib import Path

from kvnotes.apps.serving.bench import BenchConfig, run_benchmark
from kvnotes.apps.serving.bench_report import markdown_table, write_outputs
from kvnotes.apps.serving.client import Client
from kvnotes.apps.serving.export import export_hf_dir
from kvnotes.apps.serving.launch import cpu_dtype
from kvnotes.apps.serving.server import VLLMServer

OUT = Path("out/serve-bench")
RUNS = [
    ("status-b32-1k4k", dict(context_tokens=(1000, 4000), policies=("in-place", "erratum"))),
    ("status-b32-8k", dict(context_tokens=(8000,), policies=("erratum",))),
]
HOW = ("benchmarks/serve_quiet/serve_status.py: --question status, one block-32 server, "
       "accuracy run (not quiet)")
dtype = cpu_dtype()
folder = export_hf_dir("smollm2-135m", dtype=dtype)
t0 = time.monotonic()
log_dir = OUT / "server-status"
log_dir.mkdir(parents=True, exist_ok=True)
server = VLLMServer(folder, served_name="smollm2-135m", python=".venv-vllm/bin/python",
                    log_path=log_dir / "server.log", max_model_len=8192, dtype=dtype,
                    kv_cache_gib=4, startup_timeout=900, extra_args=["--block-size", "32"])
with server:
    print(f"[{time.strftime('%T')}] server up after {time.monotonic() - t0:.0f}s "
          f"load {os.getloadavg()}", flush=True)
    for name, kw in RUNS:
        config = BenchConfig(model="smollm2-135m", requests_per_row=16, block_size=32,
                             request_timeout_s=1800, concurrency=(1,), sessions=4, edits=4,
                             question="status", max_tokens=24, **kw)
        print(f"[{time.strftime('%T')}] {name}: {kw} load {os.getloadavg()}", flush=True)
        result = run_benchmark(Client(server.url, timeout=1800), config,
                               log=lambda s: print(s, flush=True))
        result["launch"] = {"dtype": dtype, "block_size": 32, "max_model_len": 8192,
                            "kv_cache_gib": 4, "command": server.cmd,
                            "startup_s": server.startup_s, "how": HOW}
        write_outputs(result, OUT / name)
        print(markdown_table(result), flush=True)
print(f"[{time.strftime('%T')}] done", flush=True)
