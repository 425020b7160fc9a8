"""Shared fixtures: tiny random models (fast tier) and the bundled real models (loaded once).

Tiny models use the real SmolLM2 tokenizer (so text looks like text), read without the model's
weights: from the converted folder when there is one, else from the GGUF's tokenizer metadata
(no conversion). Real-model fixtures are session-scoped: each real model loads once per test
session, and every test that uses one is marked ``real`` here, so ``-m "not real"`` (``make
test-fast``) never loads or converts a real model.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import kvnotes
from kvnotes.apps.agent.skills import skill_text
from kvnotes.core.errors import ServingError
from kvnotes.core.models import BUNDLED, kvnotes_home

REAL_FIXTURES = {"smollm2", "gemma3", "real_engine", "qwen05", "qwen15"}
# the opt-in tier at deployment size (`make test-large`): skipped unless KVNOTES_TEST_LARGE=1
LARGE_FIXTURES = {"qwen15"}
LARGE = os.environ.get("KVNOTES_TEST_LARGE") == "1"
_THIS = sys.modules[__name__]


@pytest.hookimpl(tryfirst=True)
def pytest_collectstart(collector: pytest.Collector) -> None:
    # Test modules import the factories below with `from conftest import ...`. pytest imports
    # every conftest.py under the module name "conftest", so a folder's own conftest (e.g.
    # tests/apps/) would shadow this one for the test modules collected after it.
    if isinstance(collector, pytest.Module):
        sys.modules["conftest"] = _THIS


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if REAL_FIXTURES & names:
            item.add_marker(pytest.mark.real)
        if LARGE_FIXTURES & names:
            item.add_marker(pytest.mark.large)
        if item.get_closest_marker("large") is not None and not LARGE:
            item.add_marker(pytest.mark.skip(reason="the large tier: `make test-large` "
                                                    "(KVNOTES_TEST_LARGE=1)"))

TINY_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)

# per-architecture extras a tiny random model of that architecture needs to build
TINY_EXTRAS: dict[str, dict] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "mistral": {"sliding_window": 8},
    "gemma3_text": {"sliding_window": 8, "head_dim": 16,
                    "layer_types": ["sliding_attention", "full_attention"]},
}


@pytest.fixture(scope="session")
def tokenizer():
    """The real SmolLM2 tokenizer (a byte-level BPE with no BOS added by default), read
    without the model weights."""
    converted = kvnotes_home() / "models" / "smollm2-135m"
    if (converted / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(converted)
    gguf = BUNDLED["smollm2-135m"].locate_gguf()
    # gguf_file with a tokenizer class reads only the vocabulary metadata, no tensors
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def make_tiny_model(model_type: str, tokenizer, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random causal LM of ``model_type`` that fits ``tokenizer``'s vocabulary."""
    kwargs = {**TINY_SIZES, "vocab_size": len(tokenizer), **TINY_EXTRAS.get(model_type, {}),
              **overrides}
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def make_tiny_engine(model_type: str, tokenizer, seed: int = 0, **overrides) -> kvnotes.Engine:
    return kvnotes.Engine.from_model(make_tiny_model(model_type, tokenizer, seed, **overrides),
                                     tokenizer)


@pytest.fixture(scope="session")
def tiny_llama(tokenizer) -> kvnotes.Engine:
    return make_tiny_engine("llama", tokenizer)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory, tokenizer) -> Path:
    """A tiny llama saved as a model folder (read-only): for the command line, and for worker
    processes, which load the model themselves."""
    folder = tmp_path_factory.mktemp("tiny-llama-folder")
    make_tiny_model("llama", tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def smollm2() -> kvnotes.Engine:
    """SmolLM2-135M-Instruct, the bundled real model (loaded once per session)."""
    return kvnotes.load("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3() -> kvnotes.Engine:
    """Gemma 3 270M base, the bundled real model (loaded once per session)."""
    return kvnotes.load("gemma3-270m")


@pytest.fixture(scope="session")
def qwen05() -> kvnotes.Engine:
    """Qwen2.5-Coder-0.5B-Instruct in bfloat16 where the CPU computes it natively (the dtype
    users are told to pick), loaded once per session."""
    from kvnotes.core.machine import preferred_dtype

    return kvnotes.load("qwen2.5-coder-0.5b", dtype=preferred_dtype())


@pytest.fixture(scope="session")
def qwen15() -> kvnotes.Engine:
    """Qwen2.5-Coder-1.5B-Instruct (the large tier only)."""
    from kvnotes.core.machine import preferred_dtype

    return kvnotes.load("qwen2.5-coder-1.5b", dtype=preferred_dtype())


@pytest.fixture(params=["smollm2", "gemma3"], scope="session")
def real_engine(request) -> kvnotes.Engine:
    return request.getfixturevalue(request.param)


@pytest.fixture(autouse=True, scope="session")
def _quiet_threads():
    # CI has 2 cores; more threads than cores only adds contention.
    torch.set_num_threads(min(2, os.cpu_count() or 2))
    yield


def home() -> Path:
    return kvnotes_home()


# ---- the session's one vLLM server ---------------------------------------------------------------
# Starting vLLM's CPU build takes minutes, so every test that needs a real server shares one.
# Its KV cache is small on purpose: 128 blocks of 32 tokens (32: the CPU attention backend takes
# block sizes in steps of 32; one block is vLLM's null block, so 4064 tokens are usable) hold the
# longest prompt any test sends (about 1.6k tokens) with room to spare, and the working set of the
# erratum benchmark (two sessions of 1.5k tokens kept cached while their edits arrive), while
# eight concurrent spliced requests of about 730 tokens each (prompt and answer) do not fit, so
# vLLM preempts some of them.
VLLM_BLOCK = 32
VLLM_KV_BLOCKS = 128
VLLM_MAX_MODEL_LEN = 2048


@pytest.fixture(scope="session")
def vllm_launch(smollm2, tmp_path_factory):
    """The running :class:`~kvnotes.serving.launch.launcher.Launch` every vLLM test shares:
    SmolLM2 in float32 (kvnotes' own numerics, so spliced output can be compared token for
    token with ``engine.compose``), prefix caching on, kvnotes' connector loaded over an empty
    skill library, and the OpenAI front in front of it (``launch.url``; vLLM itself is at
    ``launch.server.url``). Tests skip only when the vLLM environment is absent.

    Each module publishes the skills it needs under names of its own (see :func:`skill_copy`)
    while the server runs, and keeps its requests in a cache namespace of its own (a tenant, or
    a salt), so what one module leaves in the skill library or the prefix cache does not change
    what another asserts.
    """
    from kvnotes.serving.front.app import FrontConfig
    from kvnotes.serving.launch.launcher import LaunchConfig, prepare
    from kvnotes.serving.launch.process import find_vllm_python

    try:
        python = find_vllm_python()
    except ServingError as err:
        pytest.skip(f"vLLM environment absent (run `make vllm`): {err}")
    root = tmp_path_factory.mktemp("vllm")
    launch = prepare(LaunchConfig(
        model="smollm2-135m", skills=root / "skills", dtype="float32", kv_cache_gib=1,
        block_size=VLLM_BLOCK, max_model_len=VLLM_MAX_MODEL_LEN, vllm_python=str(python),
        log_path=root / "server.log", startup_timeout=1800,
        extra_args=("--num-gpu-blocks-override", str(VLLM_KV_BLOCKS)),
        front=FrontConfig(guard=0.0)),  # no guard: answers are compared with ComposeClient's
        smollm2)
    assert launch.skills is not None and launch.front is not None
    with launch:
        _RUNNING.append(launch)
        try:
            yield launch
        finally:
            _RUNNING.remove(launch)
    # the server process (and every process it started) is gone
    assert launch.server.proc is not None and launch.server.proc.poll() is not None
    assert launch.server.alive_pids() == [], f"left running: {launch.server.alive_pids()}"


_RUNNING: list = []  # the session's launched server while it runs


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # A failed vLLM test shows what the server logged last: on CI that log is the only trace
    # of a server that stopped answering.
    outcome = yield
    report = outcome.get_result()
    if report.failed and _RUNNING and item.get_closest_marker("vllm") is not None:
        server = _RUNNING[-1].server
        report.sections.append((f"vLLM server log {server.log_path} (last lines)",
                                server.log_tail(80) or "(empty)"))


def skill_copy(name: str, owner: str) -> str:
    """The bundled skill ``name`` with ``owner`` (a test module) in its heading: a text no other
    module registers. The session's server has one skill library, and among entries with the
    same tokens it splices the one compiled where it is placed, so one text registered by two
    modules with different anchors would change the other module's answers."""
    heading, rest = skill_text(name).split("\n", 1)
    return f"{heading} ({owner})\n{rest}"


def wait_for_rescan() -> None:
    """Let the running server see skills just published: the connector and the front rescan
    the library folder at most every 0.25 s."""
    time.sleep(1.0)
