"""One real vLLM server per test session, shared by every vLLM test (startup costs minutes).

It runs SmolLM2 in float32 (kvnotes' own numerics, so spliced output can be compared token for
token with ``engine.compose``) with prefix caching on and kvnotes' connector loaded; requests
without the splice salt are served exactly as without kvnotes, so the erratum benchmark shares
it. CI builds the vLLM environment (`make test` depends on `make vllm`); elsewhere vLLM tests
skip only when that environment is absent.
"""

from __future__ import annotations

import pytest

from kvnotes.apps.agent.prompt import HEADER
from kvnotes.apps.serving.launch import compose_server
from kvnotes.apps.serving.server import find_vllm_python
from kvnotes.core.errors import ServingError


@pytest.fixture(scope="session")
def vllm_python():
    try:
        return find_vllm_python()
    except ServingError as err:
        pytest.skip(f"vLLM environment absent (run `make vllm`): {err}")


@pytest.fixture(scope="session")
def serving(vllm_python, smollm2, tmp_path_factory):
    """``(server, skills)``: a started server with the connector and its skill folder, the
    system header already registered."""
    root = tmp_path_factory.mktemp("vllm")
    server, skills = compose_server(smollm2, "smollm2-135m", root / "skills", dtype="float32",
                                    kv_cache_gib=1, python=str(vllm_python),
                                    log_path=root / "server.log", max_model_len=4096)
    skills.add(HEADER, name="header")
    with server:
        yield server, skills
    # the server process (and every process it started) is gone
    assert server.proc is not None and server.proc.poll() is not None
    assert server.alive_pids() == [], f"left running: {server.alive_pids()}"
