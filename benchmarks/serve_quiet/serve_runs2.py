"""Quiet-phase serving runs for issue 15, part 2 (after serve_runs.py's c=1 rows at block 32): the
c=16 erratum rows on that still-running block-32 server (argv: URL PID, stopped after), then
erratum at 8k c=1 on block 64 and 128 servers. Cut to the erratum policy: in-place/cold at 8k
cost ~40 s a request on vLLM-CPU, and the goals compare the erratum with itself (c=16 vs c=1)
or follow the block size."""
import os
import signal
import subprocess
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
HOW = ("benchmarks/serve_quiet/serve_runs2.py: rows run in sequence on a quiet machine; erratum policy only "
       "(in-place and cold at this context are in matrix-b32-c1)")


def run(url, name, bs, **kw):
    config = BenchConfig(model="smollm2-135m", requests_per_row=16, block_size=bs,
                         request_timeout_s=900, **{"sessions": 4, "edits": 4, **kw})
    print(f"[{time.strftime('%T')}] {name}: {kw} load {os.getloadavg()}", flush=True)
    result = run_benchmark(Client(url, timeout=900), config, log=lambda s: print(s, flush=True))
    result["launch"] = {"block_size": bs, "how": HOW}
    write_outputs(result, OUT / name)
    print(markdown_table(result), flush=True)


url32 = sys.argv[1]
run(url32, "matrix-b32-c16", 32, context_tokens=(1000, 4000, 8000), concurrency=(16,),
    policies=("erratum",), sessions=16, edits=1)
pid32 = int(sys.argv[2])
os.kill(pid32, signal.SIGTERM)
for _ in range(120):
    if subprocess.run(["pgrep", "-f", "VLLM::"], capture_output=True).returncode != 0:
        break
    time.sleep(1)
subprocess.run(["pkill", "-9", "-f", "VLLM::"])
print(f"[{time.strftime('%T')}] block-32 server stopped", flush=True)
dtype = cpu_dtype()
folder = export_hf_dir("smollm2-135m", dtype=dtype)
for bs in (128, 64):
    log_dir = OUT / f"server-b{bs}"
    log_dir.mkdir(parents=True, exist_ok=True)
    server = VLLMServer(folder, served_name="smollm2-135m", python=".venv-vllm/bin/python",
                        log_path=log_dir / "server.log", max_model_len=8192, dtype=dtype,
                        kv_cache_gib=4, startup_timeout=900, extra_args=["--block-size", str(bs)])
    with server:
        run(server.url, f"block-{bs}", bs, context_tokens=(8000,), concurrency=(1,),
            policies=("erratum",))
