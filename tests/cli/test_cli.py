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
