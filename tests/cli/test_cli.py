"""The command line: clear errors with exit code 2, JSON output, on a tiny saved model."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvnotes.cli import app

runner = CliRunner()


def test_unknown_model_alias_exits_2_with_message():
    result = runner.invoke(app, ["compose", "--model", "no-such-model", "--skill", "x.txt",
                                 "--context", "c", "--query", "q"])
    assert result.exit_code == 2
    assert "unknown model 'no-such-model'" in result.output


def test_compose_json_on_tiny_folder(tiny_folder, tmp_path):
    skill = tmp_path / "refunds.txt"
    # longer than the 32 first tokens compose recomputes by default: the rest is reused
    skill.write_text("Refunds are issued within five days of inspection. " * 8)
    result = runner.invoke(app, ["compose", "--model", str(tiny_folder), "--skill", str(skill),
                                 "--context", "Customer asks when the money arrives.",
                                 "--query", " Answer:", "--max-new-tokens", "3", "--json",
                                 "--library", str(tmp_path / "lib")])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{"):])
    assert data["tokens_reused"] > 0 and data["tokens_repaired"] == 32
    assert 0.0 < data["logit_cosine"] <= 1.0 + 1e-9
    assert list((tmp_path / "lib").rglob("*.safetensors"))  # compiled once, stored by content


def test_compose_missing_skill_file_is_clear(tiny_folder, tmp_path):
    result = runner.invoke(app, ["compose", "--model", str(tiny_folder), "--skill",
                                 str(tmp_path / "nope.txt"), "--context", "c", "--query", "q"])
    assert result.exit_code == 2 and "no skill file at" in result.output


def test_models_list_names_the_aliases():
    result = runner.invoke(app, ["models", "list"])
    assert result.exit_code == 0
    assert "smollm2-135m" in result.output and "gemma3-270m" in result.output


def test_edit_eval_resume_and_shards(tiny_folder, tmp_path):
    """A stopped or smaller run is continued with --resume; a run that would drop measured
    cases from its own results.json is refused, and a missing --resume-from file is named."""
    out = tmp_path / "run"
    base = ["edit", "--model", str(tiny_folder), "--strategies", "recompute,erratum",
            "--per-family", "1", "--out", str(out), "--threads", "1"]
    first = runner.invoke(app, [*base, "--families", "refund"])
    assert first.exit_code == 0, first.output
    more = runner.invoke(app, [*base, "--families", "refund,lookup", "--resume"])
    assert more.exit_code == 0, more.output
    assert "resuming: 1 of 2 cases taken from earlier results" in more.output
    data = json.loads((out / "results.json").read_text())
    assert data["n_cases"] == 2 and data["n_resumed"] == 1
    lose = runner.invoke(app, [*base, "--families", "lookup", "--resume"])
    assert lose.exit_code == 2 and "which rewriting it would lose" in lose.output
    same = runner.invoke(app, [*base, "--families", "lookup", "--resume-from",
                               str(out / "results.json")])  # the file this run rewrites
    assert same.exit_code == 2 and "which rewriting it would lose" in same.output
    assert json.loads((out / "results.json").read_text())["n_cases"] == 2  # nothing lost
    missing = runner.invoke(app, [*base, "--families", "lookup", "--shard", "1/2",
                                  "--out", str(tmp_path / "s1"),
                                  "--resume-from", str(tmp_path / "nope.json")])
    assert missing.exit_code == 2 and "no such file" in missing.output


def test_edit_eval_workers_match_one_process(tiny_folder, tmp_path):
    """--workers 2 gives the one-process run's decisions, says so in the report, and a bad
    count is refused before anything loads."""
    base = ["edit", "--model", str(tiny_folder), "--strategies", "recompute,erratum",
            "--per-family", "1", "--families", "refund,lookup", "--threads", "1"]
    one = runner.invoke(app, [*base, "--out", str(tmp_path / "one")])
    two = runner.invoke(app, [*base, "--out", str(tmp_path / "two"), "--workers", "2"])
    assert one.exit_code == 0 and two.exit_code == 0, one.output + two.output
    a, b = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("one", "two"))
    assert b["workers"] == 2 and b["n_cases"] == a["n_cases"] == 2
    assert [[r["decision"] for r in c["rows"]] for c in b["cases"]] == [
        [r["decision"] for r in c["rows"]] for c in a["cases"]]
    assert "2 worker processes ran the cases" in (tmp_path / "two" / "report.md").read_text()
    bad = runner.invoke(app, [*base, "--workers", "0"])
    assert bad.exit_code == 2 and "--workers must be at least 1, got 0" in bad.output


def test_trace_on_tiny_folder_writes_the_report(tiny_folder, tmp_path):
    """``kvnotes trace`` end to end: every traced case streamed to cases.jsonl, the summary
    table printed, report.md and summary.json written."""
    out = tmp_path / "trace"
    result = runner.invoke(app, ["trace", "--model", str(tiny_folder), "--task", "scheduling",
                                 "--cases", "1", "--boot", "10", "--position-bins", "2",
                                 "--grid-bins", "0", "--no-by-layer", "--threads", "1",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "| scheduling |" in result.output, result.output
    streamed = (out / "cases.jsonl").read_text().splitlines()
    assert len(streamed) == 1, result.output
    assert json.loads(streamed[0])["case_id"].startswith("scheduling-")
    summary = json.loads((out / "summary.json").read_text())
    assert [(f["family"], f["n_cases"]) for f in summary["families"]] == [("scheduling", 1)]
    assert (out / "report.md").read_text().startswith("# Notes tracing: ")


def test_trace_sensitivity_writes_counts_without_tracing(tiny_folder, tmp_path):
    out = tmp_path / "sens"
    result = runner.invoke(app, ["trace", "--sensitivity", "--model", str(tiny_folder),
                                 "--task", "routing", "--split", "dev", "--cases", "2",
                                 "--threads", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "| routing | 2 |" in result.output
    data = json.loads((out / "sensitivity.json").read_text())
    assert data["split"] == "dev" and [c["case_id"] for c in data["cases"]] == [
        "routing-s0", "routing-s8"]
    assert "load average" in (out / "sensitivity.md").read_text()
    assert not (out / "cases.jsonl").exists()


# ---- kvnotes serve ----------------------------------------------------------------------------
def _serve_command():
    import typer

    return typer.main.get_command(app).commands["serve"]


def test_serve_takes_at_most_15_parameters():
    """MODEL and the options, --config included (not --help, not the vLLM flags after --)."""
    from kvnotes.serving.config_file import FLAGS

    params = [p for p in _serve_command().params if p.name not in ("help", "vllm_args")]
    assert len(params) <= 15, [p.name for p in params]
    options = {o for p in params for o in getattr(p, "opts", ()) if o.startswith("--")}
    assert options == {*FLAGS.values(), "--config"}


def _launched(monkeypatch, *args: str):
    """The LaunchConfig ``kvnotes serve ARGS`` would start (nothing loaded, nothing started)."""
    import kvnotes
    from kvnotes.serving.launch import launcher

    seen = []

    def fake_prepare(config, engine=None):
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr(kvnotes, "load", lambda model: None)
    monkeypatch.setattr(launcher, "prepare", fake_prepare)
    result = runner.invoke(app, ["serve", *args])
    assert seen, result.output
    return seen.pop()


def test_serve_options_override_the_config_file(tmp_path, monkeypatch):
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: tiny\nskills: {tmp_path / 'file-skills'}\nport: 8000\n"
                      "guard: 0.5\nlimits: {max_tools: 7}\nlearning: {enabled: true, after: 5}\n"
                      "vllm_args: [--seed, '1']\n")
    launch = _launched(monkeypatch, "--config", str(config))
    assert (launch.model, launch.skills, launch.extra_args) == ("tiny", tmp_path / "file-skills",
                                                                ("--seed", "1"))
    assert launch.front is not None and launch.front.learn is not None
    assert (launch.front.port, launch.front.guard, launch.front.max_tools) == (8000, 0.5, 7)
    launch = _launched(monkeypatch, "other", "--config", str(config), "--port", "9000",
                       "--guard", "0", "--skills", str(tmp_path / "cli-skills"), "--",
                       "--seed", "2")
    assert (launch.model, launch.skills, launch.extra_args) == ("other", tmp_path / "cli-skills",
                                                                ("--seed", "2"))
    assert launch.front is not None and launch.front.learn is not None
    assert (launch.front.port, launch.front.guard, launch.front.max_tools) == (9000, 0.0, 7)
    assert launch.front.learn.after == 5  # what the command line did not give: the file's


def test_serve_refuses_a_bad_file_before_loading_the_model(tmp_path, monkeypatch):
    import kvnotes

    monkeypatch.setattr(kvnotes, "load", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("the model was loaded before the settings were checked")))
    config = tmp_path / "serve.toml"
    config.write_text('skills = "s"\n[limits]\nmax_concurrent = 0\n')
    result = runner.invoke(app, ["serve", "--config", str(config)])
    assert result.exit_code == 2 and "limits.max_concurrent" in result.output, result.output
    config.write_text('skills = "s"\n[learning]\nlearn_after = 3\n')
    result = runner.invoke(app, ["serve", "--config", str(config)])
    assert result.exit_code == 2, result.output
    assert "unknown setting 'learning.learn_after'" in result.output
    assert str(config) in "".join(result.output.split())
    result = runner.invoke(app, ["serve", "--skills", "s", "--learn-after", "3"])
    assert result.exit_code == 2 and "--learn-after" in result.output  # moved to the file
    result = runner.invoke(app, ["serve", "--port", "8000"])
    assert result.exit_code == 2 and "give --skills DIR" in result.output


def test_serve_help_says_where_each_moved_option_went():
    from kvnotes.cli.serve import MOVED

    result = runner.invoke(app, ["serve", "--help"], terminal_width=400)
    text = " ".join(result.output.split())
    assert result.exit_code == 0
    for flag, key in MOVED.items():
        assert f"{flag} -> {key}" in text
