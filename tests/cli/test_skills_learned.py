"""``kvnotes skills list/pin/forget`` over learned entries, and ``kvnotes serve``'s learning
flags, on a tiny saved model."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvnotes
from kvnotes.cli import app
from kvnotes.core.document import encode
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.serving.config_file import ServeConfig, load_serve_config
from kvnotes.serving.front.config import LearnConfig
from kvnotes.serving.learning import Learner
from kvnotes.serving.library.registry import LearnedRegistry
from kvnotes.serving.planning.chunks import SeenChunk
from kvnotes.serving.skills import ServingSkills

runner = CliRunner()
HEADER = "System: answer with one tool call.\n"
TOOL = ('{"type": "function", "function": {"name": "get_weather", "description": "Weather for '
        'a city today", "parameters": {"city": "string"}}}')


@pytest.fixture
def served(tiny_folder, tmp_path):
    """A skills root with one registered skill and one chunk learned for tenant acme."""
    engine = kvnotes.load(str(tiny_folder))
    lib = ServingSkills(tmp_path / "skills", engine)
    registered = lib.add(HEADER, name="header")
    learner = Learner(LearnConfig(after=1, min_tokens=4), lib)
    tok = engine.tokenizer
    learner.observe("acme", [SeenChunk("tool", TOOL, tuple(encode(tok, TOOL)),
                                       tuple(encode(tok, HEADER)))])
    assert learner.run_pending() == 1
    (entry,) = learner.registry.entries()
    learner.use([entry.key])
    learner.enforce()  # writes the hit
    return tmp_path / "skills", lib, registered.key, entry.key


def test_list_shows_registered_and_learned_entries(served, tiny_folder):
    root, _, registered, learned = served
    result = runner.invoke(app, ["skills", "list", "--model", str(tiny_folder), "--skills",
                                 str(root)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    # registered skills grouped with their variants; the learned entry only in its own row
    assert any(line.startswith("header\t") and "variant(s)" in line for line in lines)
    assert any(line.startswith("  position ") and line.endswith(f"\t{registered}")
               for line in lines)
    (row,) = [line for line in lines if learned in line]
    assert row.startswith("learned tool-") and "tenant acme" in row and "1 hits" in row
    assert "evictable" in row


def test_pin_and_forget_by_key_prefix(served):
    root, lib, _, learned = served
    result = runner.invoke(app, ["skills", "pin", learned[:8], "--skills", str(root)])
    assert result.exit_code == 0, result.output
    assert f"{learned}\tpinned" in result.output
    with LearnedRegistry(lib.folder) as reg:
        assert reg.get(learned) is not None and reg.get(learned).pinned
    result = runner.invoke(app, ["skills", "forget", learned, "--skills", str(root)])
    assert result.exit_code == 0, result.output
    assert not lib.entry_path(learned).exists()
    with LearnedRegistry(lib.folder) as reg:
        assert learned not in reg


@pytest.mark.parametrize("command", ["pin", "forget"])
def test_unknown_short_and_registered_keys_are_clear_errors(served, command):
    root, lib, registered, _ = served
    for key, message in (("0123456789abcdef", "no learned entry"),
                         ("abc", "not an entry key"),
                         (registered, "registered skill")):
        result = runner.invoke(app, ["skills", command, key, "--skills", str(root)])
        assert result.exit_code == 2, result.output
        assert message in result.output
    assert lib.entry_path(registered).exists()


def _serve(**learning) -> ServeConfig:
    """``kvnotes serve --skills x`` with ``learning.<key>`` settings (``enabled``: --learn)."""
    return load_serve_config(None, given={"skills": Path("x"), **{
        f"learning.{k}": v for k, v in learning.items()}}, env={})


def _learning(**learning) -> LearnConfig | None:
    return _serve(**learning).learn_config()


def test_serve_learning_flags():
    assert _learning() is None
    cfg = _learning(enabled=True, after=3, min_tokens=16, library_cap="256MiB",
                    tenant_quota="1MB")
    assert cfg == LearnConfig(after=3, min_tokens=16, library_cap=256 << 20,
                              tenant_quota=10**6)
    assert _learning(enabled=True) == LearnConfig()  # the library's defaults, all of them
    assert _learning(enabled=True, max_variants=2).max_variants == 2
    assert _learning(enabled=True, compile_nice=19).compile_nice == 19
    # vLLM's block: the one given, else the library's for a learning front, else vLLM's
    opts = _serve(enabled=True)
    assert opts.launch_config(opts.front_config()).block_size == LearnConfig().block_size == 32
    plain = _serve()
    assert plain.launch_config(plain.front_config()).block_size is None
    given = load_serve_config(None, given={"skills": Path("x"), "learning.enabled": True,
                                           "block_size": 128}, env={})
    assert given.launch_config(given.front_config()).block_size == 128
    with pytest.raises(InvalidArgumentError, match="add --learn"):
        _learning(library_cap="1GiB")


def test_serve_learning_settings_from_the_config_file(tmp_path):
    config = tmp_path / "serve.toml"
    config.write_text("[learning]\nenabled = true\ncompile_nice = 20\n")
    result = runner.invoke(app, ["serve", "--skills", "x", "--config", str(config)])
    assert result.exit_code == 2 and "learning.compile_nice" in result.output
    config.write_text("[learning]\nlibrary_cap = \"1GiB\"\n")
    result = runner.invoke(app, ["serve", "--skills", "x", "--config", str(config)])
    assert result.exit_code == 2 and "add --learn" in result.output
    result = runner.invoke(app, ["serve", "--skills", "x", "--learn", "--no-front"])
    assert result.exit_code == 2 and "drop --no-front" in result.output


def test_list_shows_a_learned_variant_with_what_it_is_behind(served, tiny_folder):
    from kvnotes.serving.planning.variant_demand import VariantCandidate

    root, lib, _, _ = served
    learner = Learner(LearnConfig(after=1, min_tokens=4), lib)
    lib.add("Context: the user is in Paris.\n", name="context", after=HEADER)
    after = tuple(lib.after_skill("context", header=HEADER))
    cand = VariantCandidate(after, "weather", tuple(encode(lib.engine.tokenizer, TOOL)),
                            len(after), "context")
    learner.observe_variants("acme", [cand])
    assert learner.run_pending() == 1
    assert learner.counters()["failures"] == 0, learner.counters()
    key = next(e.key for e in learner.registry.entries() if e.variant_of is not None)
    result = runner.invoke(app, ["skills", "list", "--model", str(tiny_folder), "--skills",
                                 str(root)])
    assert result.exit_code == 0, result.output
    (row,) = [line for line in result.stdout.splitlines() if key in line]
    assert row.startswith("learned weather\tvariant of weather\tbehind context "
                          f"({len(after)} tokens)")
    assert "tenant acme" in row and "0 hits (0 exact)" in row
