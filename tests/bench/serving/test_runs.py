"""Benchmarks against a running or launched server: the target, the fitted context length, rows
on one launched (fake) server, and the stored rows of benchmarks/serve_quiet/erratum_rows.py."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.serving.launch.launcher import LaunchConfig
from kvnotes_bench.serving.erratum import ErratumBenchConfig
from kvnotes_bench.serving.runs import Target, erratum_launch, run_erratum_rows

ROOT = Path(__file__).parents[3]
RESULTS = ROOT / "docs" / "results" / "serve-bench"


def test_target_is_a_url_or_a_launch():
    with pytest.raises(InvalidArgumentError, match="exactly one of --url URL"):
        Target()
    with pytest.raises(InvalidArgumentError, match="exactly one of --url URL"):
        Target(url="http://127.0.0.1:1", launch=LaunchConfig())
    with pytest.raises(InvalidArgumentError, match="--request-timeout must be positive"):
        Target(url="http://127.0.0.1:1", request_timeout_s=0)


def test_context_length_fitted_to_the_longest_prompt(fake_launch):
    base = LaunchConfig(max_model_len=None)
    assert erratum_launch(base, ErratumBenchConfig(context_tokens=(1000,))).max_model_len == 4096
    assert erratum_launch(base, ErratumBenchConfig(context_tokens=(6000,))).max_model_len == 7168
    # never past the model's positions; an explicit length is kept
    assert erratum_launch(base, ErratumBenchConfig(context_tokens=(8000,))).max_model_len == 8192
    assert erratum_launch(LaunchConfig(max_model_len=2048),
                          ErratumBenchConfig()).max_model_len == 2048


def test_rows_run_in_order_on_one_launched_server(fake_launch, tmp_path):
    rows = [(name, ErratumBenchConfig(context_tokens=(200,), sessions=1, edits=1, concurrency=(1,),
                               policies=("erratum",), errata=form))
            for name, form in (("a", "append"), ("b", "latest"))]
    lines: list[str] = []
    run_erratum_rows(rows, LaunchConfig(block_size=32, max_model_len=None,
                                        log_path=tmp_path / "server.log"),
                     out=tmp_path / "out", how="the test", log=lines.append)
    # one server for both rows
    assert fake_launch == [{"extra_args": ["--block-size", "32"], "dtype": "float32",
                            "max_model_len": 4096}]
    for name, form in (("a", "append"), ("b", "latest")):
        data = json.loads((tmp_path / "out" / name / "result.json").read_text())
        assert data["config"]["errata"] == form and data["config"]["block_size"] == 32
        assert data["how"] == "the test" and data["launch"]["block_size"] == 32
        assert data["summaries"][0]["ok"] == 1
    assert lines[-1].endswith("done")
    with pytest.raises(InvalidArgumentError, match="no rows"):
        run_erratum_rows([], LaunchConfig(), out=tmp_path, how="-")


def _script():
    path = ROOT / "benchmarks" / "serve_quiet" / "erratum_rows.py"
    spec = importlib.util.spec_from_file_location("erratum_rows", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


def test_stored_rows_reproduce_the_stored_configs():
    """Each row of erratum_rows.py measures what its docs/results/serve-bench folder holds;
    results without the question or errata key were measured with decision / append."""
    rows = _script().ROWS
    # the erratum workload's results (other workloads name theirs: "workload": "soak")
    stored = {p.parent.name for p in RESULTS.glob("*/result.json")
              if "workload" not in json.loads(p.read_text())}
    assert set(rows) == stored
    for name, row in rows.items():
        data = json.loads((RESULTS / name / "result.json").read_text())
        want = {"question": "decision", "errata": "append", **data["config"]}
        mine = asdict(row.config)
        for key, value in want.items():
            got = mine[key]
            assert (list(got) if isinstance(got, tuple) else got) == value, (name, key)
        assert data["server"]["block_size"] == row.config.block_size
        if data.get("launch", {}).get("kv_cache_gib"):
            assert data["launch"]["kv_cache_gib"] == row.kv_cache_gib, name


def test_script_refuses_rows_of_different_servers(capsys):
    script = _script()
    with pytest.raises(SystemExit) as err:
        script.main(["block-64", "block-128"])
    assert err.value.code == 2 and "need different servers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main(["no-such-row"])
    assert script.main(["--list"]) == 0 and "matrix-b32-c1" in capsys.readouterr().out
