"""The launcher without a server: the configuration's checks and the command line it builds."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import httpx2
import pytest
from conftest import make_tiny_engine
from typer.testing import CliRunner

import kvnotes
from kvnotes.cli import app
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.repair import Repair
from kvnotes.serving.front.app import STATS_PATH, FrontConfig
from kvnotes.serving.front.config import LearnConfig
from kvnotes.serving.launch import launcher as launch_mod
from kvnotes.serving.launch.launcher import (
    Launch,
    LaunchConfig,
    kv_transfer_config,
    prepare,
    tool_call_parser,
)
from kvnotes.serving.launch.paths import SOURCE_ROOT
from kvnotes.serving.launch.process import VLLMServer, check_kv_cache_gib

WHOLE_GIB = r"whole GiB .*e\.g\. --kv-cache-gib 1"


@pytest.fixture(scope="module")
def engine(tokenizer):
    return make_tiny_engine("llama", tokenizer)


@pytest.fixture
def exported(tmp_path, monkeypatch):
    """A stand-in for the model export: a folder with a config, no weights converted."""
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    calls: list[tuple[str, str]] = []

    def fake_export(model: str, dtype: str) -> Path:
        calls.append((model, dtype))
        return folder

    monkeypatch.setattr(launch_mod, "export_hf_dir", fake_export)
    return folder, calls


# ---- kv cache size -------------------------------------------------------------------------------
@pytest.mark.parametrize("gib", [0.1, 1.5, 0, -2, math.nan, math.inf, True, "2"])
def test_kv_cache_gib_must_be_whole(gib):
    with pytest.raises(InvalidArgumentError, match=WHOLE_GIB):
        LaunchConfig(kv_cache_gib=gib)
    with pytest.raises(InvalidArgumentError, match=WHOLE_GIB):
        VLLMServer(Path("."), served_name="m", python=sys.executable, kv_cache_gib=gib)


def test_whole_floats_become_ints():
    assert check_kv_cache_gib(3.0) == 3 and LaunchConfig(kv_cache_gib=4.0).kv_cache_gib == 4
    server = VLLMServer(Path("."), served_name="m", python=sys.executable, kv_cache_gib=3.0)
    assert server.env["VLLM_CPU_KVCACHE_SPACE"] == "3"


def test_the_server_reuses_its_compiled_model_unless_the_operator_says_otherwise(monkeypatch):
    """vLLM 0.32's CPU build cannot load its own AOT artifact back: AOT is off by default, so a
    restart loads inductor's cache instead of compiling again."""
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    server = VLLMServer(Path("."), served_name="m", python=sys.executable)
    assert server.env["VLLM_USE_AOT_COMPILE"] == "0"
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    server = VLLMServer(Path("."), served_name="m", python=sys.executable)
    assert server.env["VLLM_USE_AOT_COMPILE"] == "1"


def test_serve_refuses_a_fraction_before_loading_the_model(tmp_path, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(kvnotes, "load", no_load)
    result = CliRunner().invoke(app, ["serve", "--skills", str(tmp_path / "skills"),
                                      "--kv-cache-gib", "0.1"])
    assert result.exit_code == 2, result.output
    assert "--kv-cache-gib" in result.output and "valid integer" in result.output
    config = tmp_path / "serve.toml"
    config.write_text(f'skills = "{tmp_path / "skills"}"\nkv_cache_gib = 0.5\n')
    result = CliRunner().invoke(app, ["serve", "--config", str(config)])
    assert result.exit_code == 2, result.output
    assert "kv_cache_gib 0.5" in result.output and "--kv-cache-gib 1" in result.output


# ---- the command line ----------------------------------------------------------------------------
def test_kv_transfer_config_recomputes_failed_loads(tmp_path):
    cfg = kv_transfer_config(tmp_path, max_gib=1.5)
    assert cfg == {"kv_connector": "KvnotesConnector",
                   "kv_connector_module_path": "kvnotes.serving.vllm.connector",
                   "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                   "kv_connector_extra_config": {"skills": str(tmp_path), "max_gib": 1.5}}


def _arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_prepare_with_skills_loads_the_connector(engine, exported, tmp_path):
    folder, calls = exported
    config = LaunchConfig(model="tiny", dtype="float32", block_size=32, kv_cache_gib=3,
                          max_model_len=None, port=5123, skills=tmp_path / "skills",
                          connector_max_gib=0.5, extra_args=("--seed", "1"),
                          log_path=tmp_path / "server.log", vllm_python=sys.executable)
    launch = prepare(config, engine)
    assert isinstance(launch, Launch) and launch.server.proc is None  # not started
    assert calls == [("tiny", "float32")]
    assert launch.skills is not None
    assert launch.skills.folder == tmp_path / "skills" / engine.fingerprint.id
    assert (launch.skills.folder / "serving.json").is_file()
    cmd = launch.server.cmd
    transfer = json.loads(_arg(cmd, "--kv-transfer-config"))
    assert transfer == kv_transfer_config(launch.skills.folder, max_gib=0.5)
    assert transfer["kv_load_failure_policy"] == "recompute"
    assert _arg(cmd, "--model") == str(folder) and _arg(cmd, "--served-model-name") == "tiny"
    assert _arg(cmd, "--block-size") == "32" and _arg(cmd, "--seed") == "1"
    assert _arg(cmd, "--max-model-len") == "2048" == str(launch.max_model_len)  # the model's
    assert _arg(cmd, "--dtype") == "float32" and _arg(cmd, "--port") == "5123"
    assert "--enable-prefix-caching" in cmd
    assert launch.server.env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert launch.server.env["PYTHONPATH"].split(":")[0] == str(SOURCE_ROOT)
    assert launch.url == "http://127.0.0.1:5123"
    record = launch.record().to_dict()
    assert record["connector"] is True and record["command"] == cmd
    assert record["pid"] is None and record["stopped"] is False and record["kv_cache_gib"] == 3


def test_plain_prepare_has_no_connector(exported, tmp_path):
    launch = prepare(LaunchConfig(model="tiny", dtype="bfloat16", max_model_len=1024,
                                  vllm_python=sys.executable))
    assert launch.skills is None and launch.record().connector is False
    assert "--kv-transfer-config" not in launch.server.cmd
    assert "--block-size" not in launch.server.cmd
    assert _arg(launch.server.cmd, "--max-model-len") == "1024"


def test_a_serving_launch_loads_no_weights_and_compiles_on_the_server(exported, tiny_folder,
                                                                      tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from kvnotes.serving.skills import manifest_for

    engine = kvnotes.load(str(tiny_folder))  # before the loaders are refused: the reference

    def refuse(*args, **kwargs):
        raise AssertionError("the front loaded the model's weights")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(kvnotes, "load", refuse)
    launch = prepare(LaunchConfig(model=str(tiny_folder), skills=tmp_path / "skills",
                                  dtype="float32", port=5124, vllm_python=sys.executable,
                                  front=FrontConfig(learn=LearnConfig())))
    skills = launch.skills
    assert skills is not None and not skills.offline and skills.server is not None
    assert skills.folder == tmp_path / "skills" / engine.fingerprint.id
    assert (skills.folder / "serving.json").read_text() == manifest_for(engine).to_json()
    launch.register("REFUNDS: within 30 days.", "refunds")  # queued until vLLM is up
    assert launch.registered == [] and not list(skills.folder.glob("*.safetensors"))
    assert launch.front is not None and launch.front.desk is not None
    assert not launch.front.desk.ready.is_set()  # /health: 503 until the skills are written


def test_the_manifest_read_from_the_files_is_the_engines(smollm2, tmp_path):
    """SmolLM2's manifest from its folder alone, byte for byte the loaded engine's."""
    from kvnotes.serving.library.model_facts import ModelFacts
    from kvnotes.serving.skills import ServingSkills, manifest_for

    facts = ModelFacts.read("smollm2-135m")
    assert facts.fingerprint == smollm2.fingerprint
    assert manifest_for(facts).to_json() == manifest_for(smollm2).to_json()
    assert ServingSkills(tmp_path, facts).path_for("x y", after="H.\n") == ServingSkills(
        tmp_path, smollm2).path_for("x y", after="H.\n")


@pytest.mark.parametrize(("field", "value", "match"), [
    ("dtype", "fp8", "use one of auto, float32"), ("block_size", 0, "positive number"),
    ("max_model_len", -1, "positive number")])
def test_bad_settings_are_refused(field, value, match):
    with pytest.raises(InvalidArgumentError, match=match):
        LaunchConfig(**{field: value})


# ---- the OpenAI front ----------------------------------------------------------------------------
def test_front_needs_skills():
    with pytest.raises(InvalidArgumentError, match="front needs skills"):
        LaunchConfig(front=FrontConfig())


class _StubServer:
    """Stands in for the vLLM process: records when it is entered and left."""

    def __init__(self, events: list[str]) -> None:
        self.events, self.url = events, "http://127.0.0.1:9"

    def __enter__(self) -> _StubServer:
        self.events.append("server up")
        return self

    def __exit__(self, *exc: object) -> None:
        self.events.append("server down")


def test_front_runs_in_front_of_the_launched_server(engine, exported, tmp_path):
    config = LaunchConfig(model="tiny", block_size=32, skills=tmp_path / "skills",
                          vllm_python=sys.executable, front=FrontConfig(repair=16, guard=0.5))
    launch = prepare(config, engine)
    front = launch.front
    assert front is not None and config.port is None  # vLLM on a free port
    assert front.service.upstream == launch.server.url
    assert front.config.block_size == 32 and front.config.repair == Repair(first=16)
    assert front.service.catalog.folder == launch.skills.folder
    events: list[str] = []
    launch.server = _StubServer(events)  # type: ignore[assignment]
    with launch:
        assert launch.url == front.url != launch.server.url
        assert httpx2.get(launch.url + STATS_PATH, timeout=10).status_code == 200
        url = launch.url
    assert events == ["server up", "server down"]
    with pytest.raises(httpx2.ConnectError):  # the front stopped with the server
        httpx2.get(url + STATS_PATH, timeout=5)


def test_serve_without_front_keeps_vllm_on_the_port(tmp_path, monkeypatch):
    seen: list[LaunchConfig] = []

    def fake_prepare(config, engine=None):
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr(kvnotes, "load", lambda model: None)
    monkeypatch.setattr(launch_mod, "prepare", fake_prepare)
    for extra, port, front in ((["--no-front"], 5001, None), ([], None, 5001)):
        CliRunner().invoke(app, ["serve", "--skills", str(tmp_path / "s"), "--port", "5001",
                                 "--repair", "8", *extra])
        config = seen.pop()
        assert config.port == port
        assert (config.front.port if config.front else None) == front
        assert config.front is None or config.front.repair == Repair(first=8)


def test_serve_passes_vllm_flags_after_the_double_dash(tmp_path, monkeypatch):
    seen: list[LaunchConfig] = []

    def fake_prepare(config, engine=None):
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr(kvnotes, "load", lambda model: None)
    monkeypatch.setattr(launch_mod, "prepare", fake_prepare)
    CliRunner().invoke(app, ["serve", "--skills", str(tmp_path / "s"), "--host", "0.0.0.0",
                             "--api-key", "sk-1", "--", "--tensor-parallel-size", "2",
                             "--gpu-memory-utilization=0.8", "--api-key", "vllm-key"])
    config = seen.pop()
    assert config.extra_args == ("--tensor-parallel-size", "2", "--gpu-memory-utilization=0.8",
                                 "--api-key", "vllm-key")
    assert config.front is not None and config.front.host == "0.0.0.0"
    assert config.front.api_key == "sk-1"
    assert launch_mod.vllm_api_key(config.extra_args) == "vllm-key"


@pytest.mark.parametrize(("flags", "match"), [
    (["--enable-lora"], "LoRA"), (["--speculative-config", '{"model": "draft"}'], "draft"),
    (["--decode-context-parallel-size", "2"], "context parallel"),
    (["--port", "9"], "use its --port option"), (["--kv-transfer-config={}"], "--skills")])
def test_serve_refuses_what_the_connector_cannot_run_before_loading(tmp_path, monkeypatch, flags,
                                                                    match):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(kvnotes, "load", no_load)
    result = CliRunner().invoke(app, ["serve", "--skills", str(tmp_path / "s"), "--", *flags])
    assert result.exit_code != 0
    assert match in result.output, result.output


def test_serve_allows_ngram_speculation(tmp_path):
    from kvnotes.serving.vllm.checks import check_vllm_args

    check_vllm_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])


def test_a_bad_key_file_fails_before_loading(tmp_path, monkeypatch):
    monkeypatch.setattr(kvnotes, "load", lambda model: pytest.fail("loaded"))
    bad = tmp_path / "keys.json"
    bad.write_text('{"keys": {"k": {"tenant": "a b"}}}')
    result = CliRunner().invoke(app, ["serve", "--skills", str(tmp_path / "s"), "--key-file",
                                      str(bad)])
    assert result.exit_code != 0 and "tenant 'a b'" in result.output, result.output


def test_a_learning_front_gets_a_learner_over_the_launched_skills(engine, exported, tmp_path):
    learn = LearnConfig(after=3, library_cap=1 << 20)
    config = LaunchConfig(model="tiny", block_size=32, skills=tmp_path / "skills",
                          vllm_python=sys.executable, front=FrontConfig(learn=learn))
    launch = prepare(config, engine)
    assert launch.front is not None and launch.front.service.learner is not None
    assert launch.front.service.learner.config == learn
    assert launch.front.service.learner.skills is launch.skills
    plain = prepare(replace(config, front=FrontConfig()), engine)
    assert plain.front is not None and plain.front.service.learner is None


def test_serve_passes_the_learning_settings_to_the_front(tmp_path, monkeypatch):
    seen: list[LaunchConfig] = []

    def fake_prepare(config, engine=None):
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr(kvnotes, "load", lambda model: None)
    monkeypatch.setattr(launch_mod, "prepare", fake_prepare)
    config = tmp_path / "serve.toml"
    config.write_text('[learning]\nafter = 3\nmin_tokens = 16\nlibrary_cap = "256MiB"\n'
                      'tenant_quota = "1GB"\n')
    CliRunner().invoke(app, ["serve", "--skills", str(tmp_path / "s"), "--learn",
                             "--config", str(config)])
    launch = seen.pop()
    assert launch.front is not None
    assert launch.front.learn == LearnConfig(after=3, min_tokens=16, library_cap=256 << 20,
                                             tenant_quota=10**9)
    assert launch.block_size == LearnConfig().block_size  # a learning server's blocks
    CliRunner().invoke(app, ["serve", "--skills", str(tmp_path / "s")])
    assert seen.pop().front.learn is None  # off: the front as without learning


# ---- tool calling ----------------------------------------------------------------------------------
QWEN_LIKE_TEMPLATE = ("{%- if tools %}You may call functions: <tools>{{ tools }}</tools> Return "
                      "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>{%- endif %}")


def test_a_template_with_tool_call_tags_gets_the_hermes_parser(exported):
    folder, _ = exported
    assert tool_call_parser(folder) is None  # no template at all
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert tool_call_parser(folder) is None  # a template without tool calls
    (folder / "chat_template.jinja").write_text(QWEN_LIKE_TEMPLATE)
    assert tool_call_parser(folder) == "hermes"
    launch = prepare(LaunchConfig(model="tiny", dtype="bfloat16", vllm_python=sys.executable))
    assert _arg(launch.server.cmd, "--tool-call-parser") == "hermes"
    assert "--enable-auto-tool-choice" in launch.server.cmd


def test_tool_parser_off_or_named_or_given_to_vllm(exported):
    folder, _ = exported
    (folder / "chat_template.jinja").write_text(QWEN_LIKE_TEMPLATE)
    off = prepare(LaunchConfig(model="tiny", dtype="bfloat16", vllm_python=sys.executable,
                               tool_parser=None))
    assert "--tool-call-parser" not in off.server.cmd
    named = prepare(LaunchConfig(model="tiny", dtype="bfloat16", vllm_python=sys.executable,
                                 tool_parser="pythonic"))
    assert _arg(named.server.cmd, "--tool-call-parser") == "pythonic"
    given = prepare(LaunchConfig(model="tiny", dtype="bfloat16", vllm_python=sys.executable,
                                 extra_args=("--tool-call-parser", "llama3_json")))
    assert given.server.cmd.count("--tool-call-parser") == 1
    assert _arg(given.server.cmd, "--tool-call-parser") == "llama3_json"


# ---- dtype ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("native", "asked", "served", "warned"), [
    (False, "bfloat16", "bfloat16", True),   # asked for: served, with the warning
    (False, "auto", "float32", False),       # auto on an AVX2-only CPU: float32
    (True, "bfloat16", "bfloat16", False),   # native: no warning
    (True, "auto", "bfloat16", False),
])
def test_emulated_bfloat16_is_served_with_a_warning(exported, monkeypatch, caplog, native, asked,
                                                   served, warned):
    monkeypatch.setattr("kvnotes.core.machine.native_bf16", lambda: native)
    with caplog.at_level("WARNING", logger="kvnotes.serving.launch"):
        out = launch_mod.export_model("smollm2-135m", asked)
    assert out.dtype == served and exported[1][-1] == ("smollm2-135m", served)
    assert ("bfloat16 on a CPU without avx512_bf16" in caplog.text) is warned
