"""--device and --dtype on every model-loading command: parsed, passed through, checked early;
``kvnotes serve``'s settings: one declaration, read from a TOML or YAML file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model
from pydantic import BaseModel
from typer.testing import CliRunner

from kvnotes.cli import app
from kvnotes.core import models
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.repair import Repair

runner = CliRunner()

COMMANDS = {
    "demo": ["demo", "--model", "m"],
    "compose": ["compose", "--model", "m", "--skill", "x.txt", "--context", "c", "--query", "q"],
    "edit": ["edit", "--model", "m"],
    "trace": ["trace", "--model", "m"],
    "agent": ["agent", "--model", "m"],
    "doctor": ["doctor", "--model", "m", "--check"],
    "repro": ["repro", "--models", "m"],
}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_device_and_dtype_reach_the_loader(name, monkeypatch, tmp_path):
    calls = []

    def fake_load(model, *, device, dtype):
        calls.append((model, str(device), str(dtype)))
        raise InvalidArgumentError("stop before loading")

    monkeypatch.setattr(models, "load", fake_load)
    args = [*COMMANDS[name], "--device", "cpu", "--dtype", "bfloat16"]
    if name in ("demo", "edit", "trace", "repro"):
        args += ["--out", str(tmp_path / "out")]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "stop before loading" in result.output
    assert calls == [("m", "cpu", "bfloat16")]


@pytest.mark.parametrize("name", ["demo", "trace", "doctor", "repro"])
def test_unavailable_device_fails_before_weights_load(name, monkeypatch, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.setattr(models, "load_folder",
                        lambda *a, **k: pytest.fail("weights loaded for a bad device"))
    args = [*COMMANDS[name], "--device", "cuda"]
    if name in ("demo", "trace", "repro"):
        args += ["--out", str(tmp_path / "out")]
    args = [a if a != "m" else "smollm2-135m" for a in args]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "device 'cuda' is not available on this machine" in result.output


@pytest.mark.parametrize("name", ["demo", "edit", "agent", "repro"])
def test_bad_dtype_is_a_usage_error(name, tmp_path):
    args = [a if a != "m" else "smollm2-135m" for a in COMMANDS[name]]
    result = runner.invoke(app, [*args, "--dtype", "int8"])
    assert result.exit_code == 2, result.output
    assert "dtype must be one of float32, float16, bfloat16, float64" in result.output


def test_doctor_tiny_check_in_bfloat16():
    result = runner.invoke(app, ["doctor", "--tiny", "llama", "--check", "--dtype", "bfloat16",
                                 "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{"):])
    assert data["check"]["error"] is None


def test_compose_on_tiny_folder_in_bfloat16(tmp_path, tokenizer):
    folder = tmp_path / "tiny"
    make_tiny_model("llama", tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    skill = tmp_path / "refunds.txt"
    # longer than the 32 first tokens compose recomputes by default: the rest is reused
    skill.write_text("Refunds are issued within five days of inspection. " * 8)
    result = runner.invoke(app, ["compose", "--model", str(folder), "--skill", str(skill),
                                 "--context", "Customer asks.", "--query", " Answer:",
                                 "--max-new-tokens", "2", "--json", "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{"):])
    assert data["tokens_reused"] > 0 and data["logit_cosine"] > 0.9


def test_model_options_set_threads_then_load(monkeypatch):
    from kvnotes.cli.options import ModelOptions

    monkeypatch.setattr(models, "load", lambda model, *, device, dtype: (model, device, dtype))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        # 0: torch's own setting is left alone (kvnotes trace --threads 0)
        assert ModelOptions("m", "cpu", "bfloat16", threads=0).load() == ("m", "cpu", "bfloat16")
        assert torch.get_num_threads() == 1
        assert ModelOptions("m", threads=2).load() == ("m", "cpu", "float32")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# ---- kvnotes serve: one declaration, a config file -------------------------------------------
SERVE_TOML = '''
model = "smollm2-135m"
skills = "skills"
port = 8000
repair = "32@0.1"
guard = 0.5
kv_cache_gib = 3
vllm_args = ["--seed", "1"]

[limits]
max_tools = 64
timeout = 120

[auth]
tenant = "acme"

[learning]
enabled = true
after = 3
library_cap = "256MiB"

[store]
mirror_bytes = "2GiB"
'''

SERVE_YAML = '''
model: smollm2-135m
skills: skills
port: 8000
repair: "32@0.1"
guard: 0.5
kv_cache_gib: 3
vllm_args: ["--seed", "1"]
limits: {max_tools: 64, timeout: 120}
auth: {tenant: acme}
learning:
  enabled: true
  after: 3
  library_cap: 256MiB
store: {mirror_bytes: 2GiB}
'''


def test_a_toml_and_a_yaml_file_give_the_same_serve_config(tmp_path):
    from kvnotes.serving.config_file import load_serve_config

    (tmp_path / "serve.toml").write_text(SERVE_TOML)
    (tmp_path / "serve.yaml").write_text(SERVE_YAML)
    toml = load_serve_config(tmp_path / "serve.toml", env={})
    yaml = load_serve_config(tmp_path / "serve.yaml", env={})
    assert toml == yaml
    front = toml.front_config()
    assert front is not None and front.learn is not None
    assert (front.max_tools, front.timeout, front.tenant, front.guard) == (64, 120.0, "acme", 0.5)
    assert (front.repair, front.mirror_bytes) == (Repair(first=32, share=0.1), 2 << 30)
    assert (front.learn.after, front.learn.library_cap) == (3, 256 << 20)
    launch = toml.launch_config(front)
    assert (launch.kv_cache_gib, launch.extra_args, str(launch.skills)) == (3, ("--seed", "1"),
                                                                            "skills")


@pytest.mark.parametrize(("text", "key"), [
    ('skills = "s"\nmax_tool = 3\n', "'max_tool'"),
    ('skills = "s"\n[limits]\nmax_toolz = 3\n', "'limits.max_toolz'"),
    ('skills = "s"\n[learning]\nafter_n = 3\n', "'learning.after_n'"),
])
def test_an_unknown_key_is_refused_with_its_name_and_the_file(tmp_path, text, key):
    from kvnotes.serving.config_file import load_serve_config

    path = tmp_path / "serve.toml"
    path.write_text(text)
    with pytest.raises(InvalidArgumentError, match="unknown setting") as err:
        load_serve_config(path, env={})
    assert key in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize(("text", "named"), [
    ("[limits]\nmax_tools = 0\n", "limits.max_tools"),
    ("[learning]\nenabled = true\nlibrary_cap = \"lots\"\n", "learning.library_cap"),
    ("[learning]\nenabled = true\ncompile_nice = 20\n", "learning.compile_nice"),
    ("kv_cache_gib = 0.5\n", "kv_cache_gib"),
    ("[auth]\napi_key = \" sk\"\n", "auth.api_key"),
    ("[auth]\ntenant = \"a b\"\n", "tenant"),
    ("[limits]\ntimeout = -1\n", "limits.timeout"),
])
def test_a_bad_value_is_refused_naming_the_setting(tmp_path, text, named):
    from kvnotes.serving.config_file import load_serve_config

    path = tmp_path / "serve.toml"
    path.write_text('skills = "s"\n' + text)
    with pytest.raises(InvalidArgumentError) as err:
        load_serve_config(path, env={})
    assert named in str(err.value)


def test_the_command_line_and_the_environment_override_the_file(tmp_path):
    from kvnotes.serving.config_file import load_serve_config

    path = tmp_path / "serve.toml"
    path.write_text('skills = "s"\nport = 8000\n[auth]\napi_key = "sk-file"\n'
                    'metrics_key = "mk-file"\n')
    env = {"KVNOTES_API_KEY": "sk-env", "KVNOTES_METRICS_KEY": "mk-env"}
    cfg = load_serve_config(path, given={"port": 9000}, env=env)
    front = cfg.front_config()
    assert front is not None
    assert (front.port, front.api_key, front.metrics_key) == (9000, "sk-env", "mk-env")
    cfg = load_serve_config(path, given={"auth.api_key": "sk-cli"}, env=env)
    assert cfg.auth.model_dump()["api_key"] == "sk-cli" and cfg.port == 8000


def test_every_front_and_learning_setting_has_a_key():
    """A field added to FrontConfig or LearnConfig is in a section of the file (or filled by
    the launcher / spelled by a top-level key), never silently out of reach."""
    import dataclasses

    from kvnotes.serving import config_file as cf
    from kvnotes.serving.front.config import FrontConfig, LearnConfig

    front = {f.name for f in dataclasses.fields(FrontConfig)}
    assert front == set(cf.LIMITS) | set(cf.AUTH) | set(cf.FRONT_FILLED)
    assert not set(cf.LIMITS) & set(cf.AUTH)
    learning = set(cf.ServeConfig.model_fields["learning"].annotation.model_fields)
    assert learning == {f.name for f in dataclasses.fields(LearnConfig)} | {"enabled"}
    for key in cf.FLAGS:
        assert cf.field_info(key).description  # each option's help


def test_the_example_config_lists_every_key_and_loads(tmp_path, monkeypatch):
    """examples/serve.toml names every setting (set, or commented out where TOML has no
    null), and what it sets is valid."""
    import re
    import tomllib

    from kvnotes.serving.config_file import ServeConfig, load_serve_config

    example = Path(__file__).parents[2] / "examples" / "serve.toml"
    listed: set[str] = set()
    section = ""
    for line in example.read_text().splitlines():
        if m := re.match(r"#?\s*\[(\w+)\]", line):
            section = m.group(1) + "."
        elif m := re.match(r"#?\s*(\w+)\s*=", line):
            listed.add(section + m.group(1))
    want = {name for name, f in ServeConfig.model_fields.items()
            if not isinstance(f.annotation, type) or not issubclass(f.annotation, BaseModel)}
    for name in ("limits", "auth", "learning", "store"):
        want |= {f"{name}.{k}" for k in ServeConfig.model_fields[name].annotation.model_fields}
    assert want <= listed, sorted(want - listed)
    assert tomllib.loads(example.read_text())  # TOML
    monkeypatch.chdir(tmp_path)
    assert isinstance(load_serve_config(example, env={}), ServeConfig)
