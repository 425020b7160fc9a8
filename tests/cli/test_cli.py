"""The command line: clear errors with exit code 2, JSON output, on a tiny saved model."""

from __future__ import annotations

import json

import pytest
from conftest import make_tiny_model
from typer.testing import CliRunner

from kvnotes.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_unknown_model_alias_exits_2_with_message():
    result = runner.invoke(app, ["compose", "--model", "no-such-model", "--skill", "x.txt",
                                 "--context", "c", "--query", "q"])
    assert result.exit_code == 2
    assert "unknown model 'no-such-model'" in result.output


def test_compose_json_on_tiny_folder(tiny_folder, tmp_path):
    skill = tmp_path / "refunds.txt"
    skill.write_text("Refunds are issued within five days of inspection.")
    result = runner.invoke(app, ["compose", "--model", str(tiny_folder), "--skill", str(skill),
                                 "--context", "Customer asks when the money arrives.",
                                 "--query", " Answer:", "--max-new-tokens", "3", "--json",
                                 "--library", str(tmp_path / "lib")])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{"):])
    assert data["tokens_reused"] > 0 and 0.0 < data["logit_cosine"] <= 1.0 + 1e-9
    assert list((tmp_path / "lib").rglob("*.safetensors"))  # compiled once, stored by content


def test_compose_missing_skill_file_is_clear(tiny_folder, tmp_path):
    result = runner.invoke(app, ["compose", "--model", str(tiny_folder), "--skill",
                                 str(tmp_path / "nope.txt"), "--context", "c", "--query", "q"])
    assert result.exit_code == 2 and "no skill file at" in result.output


def test_models_list_names_the_aliases():
    result = runner.invoke(app, ["models", "list"])
    assert result.exit_code == 0
    assert "smollm2-135m" in result.output and "gemma3-270m" in result.output
