"""One block-32 vLLM server (SmolLM2, launched from .venv-vllm) running several serve-bench
configs in sequence, each written to out/serve-bench/<name>/ as soon as it finishes. Shared by
serve_runs3.py and serve_status.py; run those from the repository root."""
import os
import time
from pathlib import Path

from kvnotes.bench.serving.erratum import BenchConfig, run_benchmark
from kvnotes.bench.serving.report import markdown_table, write_outputs
from kvnotes.serving.client import Client
from kvnotes.serving.export import export_hf_dir
from kvnotes.serving.launch import cpu_dtype
from kvnotes.serving.server import VLLMServer

OUT = Path("out/serve-bench")


def run_configs(runs, *, server_dir, kv_cache_gib, how, **defaults):
    """``runs``: (name, BenchConfig overrides); ``defaults`` apply to every config."""
    dtype = cpu_dtype()
    folder = export_hf_dir("smollm2-135m", dtype=dtype)
    t0 = time.monotonic()
    log_dir = OUT / server_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    server = VLLMServer(folder, served_name="smollm2-135m", python=".venv-vllm/bin/python",
                        log_path=log_dir / "server.log", max_model_len=8192, dtype=dtype,
                        kv_cache_gib=kv_cache_gib, startup_timeout=900,
                        extra_args=["--block-size", "32"])
    with server:
        print(f"[{time.strftime('%T')}] server up after {time.monotonic() - t0:.0f}s "
              f"load {os.getloadavg()}", flush=True)
        for name, kw in runs:
            config = BenchConfig(**{"model": "smollm2-135m", "requests_per_row": 16,
                                    "block_size": 32, "request_timeout_s": 1800,
                                    **defaults, **kw})
            print(f"[{time.strftime('%T')}] {name}: {kw} load {os.getloadavg()}", flush=True)
            result = run_benchmark(Client(server.url, timeout=1800), config,
                                   log=lambda s: print(s, flush=True))
            result["launch"] = {"dtype": dtype, "block_size": 32, "max_model_len": 8192,
                                "kv_cache_gib": kv_cache_gib, "command": server.cmd,
                                "startup_s": server.startup_s, "how": how}
            write_outputs(result, OUT / name)
            print(markdown_table(result), flush=True)
    print(f"[{time.strftime('%T')}] done", flush=True)
