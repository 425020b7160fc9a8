"""Quiet-phase serving runs for issue 15 (docs/serving.md, "Measured: the matrix"): one vLLM
server per block size, several bench configs each, run from the repository root on a quiet
machine. The 2026-11-30 run was stopped after its first config (c=1 rows at block 32) and
continued by serve_runs2.py, because in-place/cold at 8k cost ~40 s a request on vLLM-CPU."""
import os
import sys
import time
from pathlib import Path

from kvnotes.bench.serving.erratum import BenchConfig, run_benchmark
from kvnotes.bench.serving.report import markdown_table, write_outputs
from kvnotes.serving.client import Client
from kvnotes.serving.export import export_hf_dir
from kvnotes.serving.launch import cpu_dtype
from kvnotes.serving.server import VLLMServer

OUT = Path("out/serve-bench")
ALL = ("in-place", "erratum", "cold")
RUNS = {
    32: [("matrix-b32-c1", dict(context_tokens=(1000, 4000, 8000), concurrency=(1,), policies=ALL)),
         ("matrix-b32-c16", dict(context_tokens=(1000, 4000, 8000), concurrency=(16,),
                                 policies=("in-place", "erratum"), sessions=16, edits=1)),
         ("matrix-b32-c4", dict(context_tokens=(1000, 4000, 8000), concurrency=(4,),
                                policies=("in-place", "erratum")))],
    64: [("block-64", dict(context_tokens=(8000,), concurrency=(1,), policies=("in-place", "erratum")))],
    128: [("block-128", dict(context_tokens=(8000,), concurrency=(1,), policies=("in-place", "erratum")))],
}
blocks = [int(b) for b in sys.argv[1].split(",")] if len(sys.argv) > 1 else [32, 64, 128]
dtype = cpu_dtype()
folder = export_hf_dir("smollm2-135m", dtype=dtype)
for bs in blocks:
    t0 = time.monotonic()
    log_dir = OUT / f"server-b{bs}"
    log_dir.mkdir(parents=True, exist_ok=True)
    server = VLLMServer(folder, served_name="smollm2-135m", python=".venv-vllm/bin/python",
                        log_path=log_dir / "server.log", max_model_len=8192, dtype=dtype,
                        kv_cache_gib=12, startup_timeout=900,
                        extra_args=["--block-size", str(bs)])
    with server:
        print(f"[{time.strftime('%T')}] block {bs}: server up after {time.monotonic()-t0:.0f}s "
              f"load {os.getloadavg()}", flush=True)
        for name, kw in RUNS[bs]:
            config = BenchConfig(model="smollm2-135m", requests_per_row=16, block_size=bs,
                                 request_timeout_s=900, **{"sessions": 4, "edits": 4, **kw})
            print(f"[{time.strftime('%T')}] {name}: {kw}", flush=True)
            result = run_benchmark(Client(server.url, timeout=900), config,
                                   log=lambda s: print(s, flush=True))
            result["launch"] = {"dtype": dtype, "block_size": bs, "max_model_len": 8192,
                                "kv_cache_gib": 12, "command": server.cmd,
                                "startup_s": server.startup_s,
                                "how": "benchmarks/serve_quiet/serve_runs.py: one server per block size, "
                                       "runs in sequence, nothing else on the machine"}
            write_outputs(result, OUT / name)
            print(markdown_table(result), flush=True)
