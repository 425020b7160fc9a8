"""serve-bench against a real vLLM server that kvnotes starts itself (CPU build, .venv-vllm).

CI builds the vLLM environment (`make test` depends on `make vllm`); elsewhere the test skips
only when that environment is absent. Startup takes about 2-3 minutes on 2 CPU cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvnotes.apps.serving import (
    BenchConfig,
    Client,
    ServingError,
    VLLMServer,
    export_hf_dir,
    find_vllm_python,
    run_benchmark,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    try:
        return find_vllm_python()
    except ServingError as err:
        pytest.skip(f"vLLM environment absent (run `make vllm`): {err}")


def test_erratum_keeps_vllm_prefix_cache_aligned(vllm_python, tmp_path):
    folder = export_hf_dir("smollm2-135m")
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    server = VLLMServer(folder, served_name="smollm2-135m", python=vllm_python,
                        log_path=tmp_path / "server.log", max_model_len=4096, kv_cache_gib=1,
                        startup_timeout=900)
    # vLLM's CPU backend caches in blocks of 128 tokens: the partly filled last block and the
    # appended errata + question stay uncached, so the context must be long enough (3000)
    # for the erratum's hit rate to clear 0.9 with a margin
    config = BenchConfig(context_tokens=(3000,), field_depth=0.1, sessions=2, edits=2,
                         concurrency=(1,), policies=("in-place", "erratum"),
                         request_timeout_s=300, time_budget_s=900)
    with server:
        assert server.startup_s is not None  # the server came up and serves the model
        pids = server.alive_pids()
        assert server.pid in pids
        result = run_benchmark(Client(server.url), config, log=print)
    # the server process (and those it started) is gone
    assert server.proc is not None and server.proc.poll() is not None
    assert server.alive_pids() == [], f"left running: {server.alive_pids()} of {pids}"
    rows = {s["policy"]: s for s in result["summaries"]}
    for s in rows.values():  # every request succeeded
        assert s["failed"] == 0 and s["skipped"] == 0 and s["ok"] == s["requests"] == 4, s
    erratum, in_place = rows["erratum"], rows["in-place"]
    assert erratum["hit_rate"] > 0.9, erratum
    assert in_place["hit_rate"] < erratum["hit_rate"]
    assert erratum["ttft_p90_s"] < in_place["ttft_p90_s"], (erratum, in_place)
    assert erratum["agreement_n"] == 4
