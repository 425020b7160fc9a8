"""The front's default guard: the per-model table, ``--guard auto|0|X`` and its resolution."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import kvnotes
from kvnotes.cli import app
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.serving.front import guard_defaults
from kvnotes.serving.front.guard_defaults import (
    GUARD_DEFAULTS,
    UNCALIBRATED,
    GuardDefault,
    guard_default,
    parse_guard,
    resolve_guard,
)
from kvnotes.serving.launch import launcher as launch_mod


@pytest.fixture
def table(monkeypatch):
    entries = {"calibrated-model": GuardDefault(0.4, "fires on 10% of dev requests"),
               "near-tie-model": GuardDefault(0.0, "fires on most requests")}
    monkeypatch.setattr(guard_defaults, "GUARD_DEFAULTS", entries)
    return entries


def test_every_bundled_model_has_a_measured_default():
    from kvnotes.core.models import BUNDLED

    # each bundled model has a measured default, or is listed as not calibrated, with why
    assert set(BUNDLED) <= set(GUARD_DEFAULTS) | set(UNCALIBRATED)
    assert not set(GUARD_DEFAULTS) & set(UNCALIBRATED)
    assert resolve_guard("auto", "qwen2.5-coder-1.5b")[1].startswith("off: not calibrated")
    for entry in GUARD_DEFAULTS.values():
        assert entry.tau >= 0 and entry.measured.strip()


def test_lookup_by_alias_path_or_file_name(table):
    assert guard_default("calibrated-model") == table["calibrated-model"]
    assert guard_default("/models/Calibrated-Model") == table["calibrated-model"]
    assert guard_default("/models/calibrated-model.gguf") == table["calibrated-model"]
    assert guard_default("some-other-model") is None


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
    assert tau == 0.0 and "kvnotes bench guard --model unmeasured" in why
    assert resolve_guard("0", "calibrated-model")[0] == 0.0
    assert resolve_guard("1.5", "near-tie-model")[0] == 1.5


def _served_guard(tmp_path, monkeypatch, *flags: str) -> tuple[float, str]:
    seen = []

    def fake_prepare(config, engine=None):
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr(kvnotes, "load", lambda model: None)
    monkeypatch.setattr(launch_mod, "prepare", fake_prepare)
    result = CliRunner().invoke(app, ["serve", "--model", "calibrated-model", "--skills",
                                      str(tmp_path / "s"), *flags])
    assert seen, result.output
    return seen.pop().front.guard, result.output


def test_serve_takes_the_calibrated_guard_unless_told(tmp_path, monkeypatch, table):
    tau, output = _served_guard(tmp_path, monkeypatch)
    assert tau == 0.4 and "guard: 0.4 for calibrated-model" in output
    assert _served_guard(tmp_path, monkeypatch, "--guard", "0")[0] == 0.0
    assert _served_guard(tmp_path, monkeypatch, "--guard", "0.7")[0] == 0.7


def test_serve_refuses_a_bad_guard_before_loading_the_model(tmp_path, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(kvnotes, "load", no_load)
    result = CliRunner().invoke(app, ["serve", "--skills", str(tmp_path / "s"), "--guard",
                                      "often"])
    assert result.exit_code == 2, result.output
    assert "--guard 'often'" in result.output
