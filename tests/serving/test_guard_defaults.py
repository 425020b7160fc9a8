"""The front's default guard: the per-model table, ``--guard auto|0|X`` and its resolution."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvnotes
from kvnotes.cli import app
from kvnotes.core import model_defaults as defaults_table
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.model_defaults import (
    MODEL_DEFAULTS,
    UNCALIBRATED,
    ModelDefaults,
    model_defaults,
)
from kvnotes.core.repair import DEFAULT_REPAIR
from kvnotes.serving.front.config import FrontConfig, LearnConfig
from kvnotes.serving.front.guard_defaults import parse_guard, resolve_guard
from kvnotes.serving.launch import launcher as launch_mod


@pytest.fixture
def table(monkeypatch):
    entries = {"calibrated-model": ModelDefaults(0.4, "fires on 10% of dev requests"),
               "near-tie-model": ModelDefaults(0.0, "fires on most requests")}
    monkeypatch.setattr(defaults_table, "MODEL_DEFAULTS", entries)
    return entries


def test_every_bundled_model_has_a_measured_default():
    from kvnotes.core.models import BUNDLED

    # each bundled model has a measured default, or is listed as not calibrated, with why
    assert set(BUNDLED) <= set(MODEL_DEFAULTS) | set(UNCALIBRATED)
    assert not set(MODEL_DEFAULTS) & set(UNCALIBRATED)
    for entry in MODEL_DEFAULTS.values():
        assert entry.guard >= 0 and entry.measured.strip()


def test_lookup_by_alias_path_or_file_name(table):
    assert model_defaults("calibrated-model") == table["calibrated-model"]
    assert model_defaults("/models/Calibrated-Model") == table["calibrated-model"]
    assert model_defaults("/models/calibrated-model.gguf") == table["calibrated-model"]
    assert model_defaults("some-other-model") is None


def test_an_engine_reads_its_defaults_from_the_table(table):
    from kvnotes.core.tiny import ByteTokenizer, tiny_model

    engine = kvnotes.Engine.from_model(tiny_model("llama", 256), ByteTokenizer(256))
    assert engine.defaults is None  # a model nobody calibrated
    engine.name = "calibrated-model"
    assert engine.defaults == table["calibrated-model"]
    assert engine.defaults.repair == DEFAULT_REPAIR


@pytest.mark.parametrize(("text", "want"), [("auto", None), (" AUTO ", None), ("0", 0.0),
                                            ("0.5", 0.5), ("2", 2.0)])
def test_parse_guard(text, want):
    assert parse_guard(text) == want


@pytest.mark.parametrize("text", ["-1", "nan", "inf", "sometimes", ""])
def test_parse_guard_refuses_what_is_no_margin(text):
    with pytest.raises(InvalidArgumentError, match="auto"):
        parse_guard(text)


def test_auto_resolves_from_the_table_and_an_explicit_value_wins(table):
    assert resolve_guard("auto", "calibrated-model")[0] == 0.4
    tau, why = resolve_guard("auto", "near-tie-model")
    assert tau == 0.0 and "off" in why and "most requests" in why
    tau, why = resolve_guard("auto", "unmeasured")
    assert tau == 0.0 and "kvnotes-bench guard --model unmeasured" in why
    assert resolve_guard("0", "calibrated-model")[0] == 0.0
    assert resolve_guard("1.5", "near-tie-model")[0] == 1.5


def _served(tmp_path, monkeypatch, *flags: str) -> tuple[launch_mod.LaunchConfig, str]:
    """The launch ``kvnotes serve --model calibrated-model FLAGS`` asks for, and its output."""
    seen = []

    def fake_prepare(config, engine=None):
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr(kvnotes, "load", lambda model: None)
    monkeypatch.setattr(launch_mod, "prepare", fake_prepare)
    result = CliRunner().invoke(app, ["serve", "calibrated-model", "--skills",
                                      str(tmp_path / "s"), *flags])
    assert seen, result.output
    return seen.pop(), result.output


def _served_guard(tmp_path, monkeypatch, *flags: str) -> tuple[float, str]:
    config, output = _served(tmp_path, monkeypatch, *flags)
    assert config.front is not None
    # the guard as the launcher's front runs it (its model: the served name)
    return dataclasses.replace(config.front, model=config.name).guard_tau(), output


def test_serve_takes_the_calibrated_guard_unless_told(tmp_path, monkeypatch, table):
    tau, output = _served_guard(tmp_path, monkeypatch)
    assert tau == 0.4 and "guard: 0.4 for calibrated-model" in output
    assert _served_guard(tmp_path, monkeypatch, "--guard", "0")[0] == 0.0
    assert _served_guard(tmp_path, monkeypatch, "--guard", "0.7")[0] == 0.7


def test_the_library_and_the_launcher_get_the_calibrated_guard(table):
    assert FrontConfig(model="calibrated-model").guard_tau() == 0.4
    assert FrontConfig(model="/models/calibrated-model.gguf").guard_tau() == 0.4
    assert FrontConfig(model="near-tie-model").guard_tau() == 0.0
    assert FrontConfig(model="unmeasured").guard_tau() == 0.0
    assert FrontConfig().guard_tau() == 0.0  # no model named: none known
    assert FrontConfig().guard_tau("calibrated-model") == 0.4  # the name vLLM serves
    assert FrontConfig(model="calibrated-model", guard=0.0).guard_tau() == 0.0  # told: off
    assert FrontConfig(model="calibrated-model", guard=1.5).guard_tau("x") == 1.5
    launch = launch_mod.LaunchConfig(model="calibrated-model", skills=Path("s"),
                                     front=FrontConfig())
    assert launch.front is not None
    assert dataclasses.replace(launch.front, model=launch.name).guard_tau() == 0.4


def test_the_cli_and_the_library_get_the_same_defaults(tmp_path, monkeypatch, table):
    """``kvnotes serve`` with no option builds the configs the library defaults to."""
    config, _ = _served(tmp_path, monkeypatch)
    library = launch_mod.LaunchConfig(model="calibrated-model", skills=config.skills,
                                      front=FrontConfig())
    assert config == library
    learning, _ = _served(tmp_path, monkeypatch, "--learn")
    assert learning == dataclasses.replace(library, block_size=None,
                                           front=FrontConfig(learn=LearnConfig()))
    assert learning.block_size == LearnConfig().block_size


def test_the_front_runs_the_served_models_guard(table):
    import asyncio

    from kvnotes.serving.front.service import FrontService
    from kvnotes.serving.planning.request import FrontOptions

    class Served:
        async def model(self) -> str:
            return "calibrated-model"

    def guard_of(config: FrontConfig, opts: FrontOptions) -> float:
        service = FrontService.__new__(FrontService)  # no pool, no metrics: guard_of alone
        service.config, service.up = config, Served()  # type: ignore[assignment]
        return asyncio.run(service.guard_of(opts))

    upstream = "http://127.0.0.1:9"
    assert guard_of(FrontConfig(upstream=upstream), FrontOptions()) == 0.4
    assert guard_of(FrontConfig(upstream=upstream, model="near-tie-model"), FrontOptions()) == 0
    assert guard_of(FrontConfig(upstream=upstream, guard=0.2), FrontOptions()) == 0.2
    assert guard_of(FrontConfig(upstream=upstream), FrontOptions(guard=0.9)) == 0.9


def test_serve_refuses_a_bad_guard_before_loading_the_model(tmp_path, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(kvnotes, "load", no_load)
    result = CliRunner().invoke(app, ["serve", "--skills", str(tmp_path / "s"), "--guard",
                                      "often"])
    assert result.exit_code == 2, result.output
    assert "--guard 'often'" in result.output
