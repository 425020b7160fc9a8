"""--device and --dtype on every model-loading command: parsed, passed through, checked early."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_model
from typer.testing import CliRunner

from kvnotes.cli import app
from kvnotes.core import models
from kvnotes.core.errors import InvalidArgumentError

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
