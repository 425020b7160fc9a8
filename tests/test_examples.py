"""The README's served example works as written from a fresh clone: it names only files the
repository ships (examples/), `kvnotes serve` accepts its command, and examples/client.py, run
against a real vLLM server that registered the example's header and skills, prints an answer and a
``usage.kvnotes`` in which the registered skills were spliced.

The vLLM test uses the session's server (``vllm_launch``) and registers the example's texts on it
as `kvnotes serve --config examples/shop.toml` does (the header as a piece, each skill file
compiled behind it), under names of this module. Its requests use the shared splice salt: their first
KV block (the example's header) is no other module's, so neither prefix cache sees the other.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import wait_for_rescan
from typer.testing import CliRunner

import kvnotes
from kvnotes.serving.protocol import UsageKvnotes

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
README = ROOT / "README.md"


def readme_shell_lines() -> list[str]:
    """The README's shell commands, one per command (continuation lines joined, comments cut)."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text("utf-8"), re.S)
    joined = "\n".join(blocks).replace("\\\n", " ")
    return [line.split(" #")[0].strip() for line in joined.splitlines() if line.strip()]


def serve_command() -> list[str]:
    lines = [line for line in readme_shell_lines() if line.startswith(".venv/bin/kvnotes serve")]
    assert len(lines) == 1, f"one `.venv/bin/kvnotes serve` command in the README: {lines}"
    return shlex.split(lines[0])


def served_config() -> dict:
    """The settings file the README's serve command reads."""
    cmd = serve_command()
    assert "--config" in cmd, cmd
    with (ROOT / cmd[cmd.index("--config") + 1]).open("rb") as f:
        return tomllib.load(f)


def test_the_readme_runs_only_what_the_repository_ships():
    named = {word for line in readme_shell_lines() for word in shlex.split(line)
             if word.startswith("examples/")}
    config = served_config()
    named |= {config["header"], *config["skill"]}
    assert "examples/client.py" in named and all(f.endswith(".txt") for f in config["skill"])
    missing = sorted(w for w in named if w != config["skills"] and not (ROOT / w).is_file())
    assert missing == [], f"the README names files examples/ does not ship: {missing}"
    # the library folder the server compiles into is kept out of git
    ignored = (EXAMPLES / ".gitignore").read_text("utf-8").split()
    assert f"{Path(config['skills']).relative_to('examples')}/" in ignored


def test_kvnotes_serve_accepts_the_readme_command(monkeypatch):
    """The command line as printed, run from the clone's root up to vLLM's start: every option
    and setting exists and every file it reads is there."""
    from kvnotes.cli import app
    from kvnotes.serving.launch import launcher

    seen = []

    def fake_prepare(config, engine=None):
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr(kvnotes, "load", lambda *args, **kwargs: None)
    monkeypatch.setattr(launcher, "prepare", fake_prepare)
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(app, serve_command()[1:])
    assert result.exit_code == 0 and len(seen) == 1, result.output
    config = seen[0]
    assert config.model == "smollm2-135m"
    assert config.front is not None and config.front.port == 8000
    assert Path(config.skills).resolve() == (ROOT / served_config()["skills"]).resolve()


def test_the_client_sends_the_registered_texts_as_they_are():
    spec = importlib.util.spec_from_file_location("example_client", EXAMPLES / "client.py")
    assert spec is not None and spec.loader is not None
    client = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(client)
    text = client.prompt("Where is my parcel?", ["shipping", "refunds"])
    files = [(EXAMPLES / f"{n}.txt").read_text("utf-8") for n in ("header", "shipping", "refunds")]
    assert text == "".join(files) + "Customer: Where is my parcel?\nAgent:"
    assert all(f.endswith("\n\n") and not f.endswith("\n\n\n") for f in files)


@pytest.mark.vllm
def test_the_example_client_gets_its_skills_spliced_on_a_real_server(vllm_launch, tmp_path):
    launch = vllm_launch
    assert launch.skills is not None and launch.front is not None
    config = served_config()
    header = (ROOT / config["header"]).read_text("utf-8")
    launch.skills.add(header, name="example-header")
    for path in config["skill"]:
        launch.skills.add((ROOT / path).read_text("utf-8"), name=f"example-{Path(path).stem}",
                          after=header)
    wait_for_rescan()

    run = subprocess.run([sys.executable, str(EXAMPLES / "client.py")], cwd=tmp_path,
                         env={**os.environ, "KVNOTES_BASE_URL": launch.url + "/v1"},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    answer = next(line for line in lines if line.startswith("Agent:"))
    assert answer.removeprefix("Agent:").strip(), run.stdout
    usage = json.loads(next(line for line in lines if line.startswith("usage.kvnotes:"))
                       .removeprefix("usage.kvnotes:"))
    info = UsageKvnotes.from_dict(usage)
    assert info.exact is None and info.plan is not None, usage
    assert info.spliced_tokens > 0
    assert list(info.plan.skills) == ["example-header", "example-refunds", "example-shipping"]
    spliced = {e.name: e.end - e.start - e.repaired for e in info.plan.entries}
    assert spliced["example-refunds"] > 0 and spliced["example-shipping"] > 0, usage
    assert "example-refunds" in info.plan.exactly_placed  # right behind the header it follows
    # the connector reported every request (the phase and the answer): it supplied the planned
    # entries, and no load failed
    assert len(info.reports) == info.phases + 1, usage
    assert all(not report.failed and report.refused is None for report in info.reports), usage
    loaded = {r.key for report in info.reports for r in report.loaded}
    assert {e.key for e in info.plan.entries if e.end - e.start > e.repaired} <= loaded, usage
    not_computed = re.search(r"not computed: (\d+)", run.stdout)
    assert not_computed is not None and int(not_computed.group(1)) >= info.spliced_tokens

