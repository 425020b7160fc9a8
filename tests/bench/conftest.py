"""Fixtures of the serving benchmarks' tests: the fake OpenAI-compatible server, in this process
or started by the launcher in place of vLLM."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvnotes.serving.launch import launcher as launch_mod
from kvnotes.serving.launch.process import VLLMServer

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
import _fake_vllm  # noqa: E402


@pytest.fixture()
def fake_server():
    """(url, state) of a fake vLLM server in a thread of this process."""
    httpd, state = _fake_vllm.serve(0, "smollm2-135m")
    yield f"http://127.0.0.1:{httpd.server_address[1]}", state
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture()
def fake_launch(tmp_path, monkeypatch):
    """The launcher starting _fake_vllm.py as a child process instead of vLLM (the model
    "exported" to ``tmp_path`` with 8192 positions); the list of what each start was given."""
    seen: list[dict] = []

    def fake_vllm(folder, *, served_name, extra_args=(), **kw):
        seen.append(dict(extra_args=list(extra_args), dtype=kw["dtype"],
                         max_model_len=kw["max_model_len"]))
        return VLLMServer(folder, served_name=served_name, python=sys.executable,
                          module="_fake_vllm", env={"PYTHONPATH": str(TESTS)},
                          log_path=kw["log_path"], startup_timeout=60, extra_args=extra_args)

    def fake_export(model, dtype="auto"):
        return launch_mod.ExportedModel(tmp_path, "float32" if dtype == "auto" else dtype, 8192)

    monkeypatch.setattr(launch_mod, "VLLMServer", fake_vllm)
    monkeypatch.setattr(launch_mod, "export_model", fake_export)
    return seen
