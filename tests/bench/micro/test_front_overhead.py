"""The front-overhead benchmark: its config, its rows, the stand-in upstream, the stored results."""

from __future__ import annotations

import ast
import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from kvnotes.core.errors import InvalidArgumentError
from kvnotes_bench.micro import overhead_servers
from kvnotes_bench.micro.front_overhead import (
    SRC,
    FrontOverheadConfig,
    FrontOverheadResult,
    OverheadRow,
    plot,
    summary,
)

STORED = sorted((Path(__file__).resolve().parents[3] / "docs" / "results" / "front-overhead")
                .glob("*.json"))


@pytest.mark.parametrize("path", STORED, ids=[p.stem for p in STORED])
def test_the_committed_results_read_back(path, tmp_path):
    data = json.loads(path.read_text())
    result = FrontOverheadResult.from_dict(data)
    assert result.to_dict() == data
    assert all(r.measured for r in result.rows) and result.front in path.stem
    plot(result, tmp_path / "overhead.png")
    assert (tmp_path / "overhead.png").stat().st_size > 0


def test_both_committed_fronts_are_there():
    assert [p.stem for p in STORED] == ["front-overhead-new", "front-overhead-old"]


def test_a_row_is_the_front_percentile_less_the_direct_one():
    row = summary("spliced", True, 1, 0, direct=[0.001, 0.002, 0.003], front=[0.011, 0.012, 0.013])
    assert row.direct_p50_ms == pytest.approx(2.0) and row.front_p50_ms == pytest.approx(12.0)
    assert row.overhead_p50_ms == pytest.approx(10.0) and row.requests == 3
    assert OverheadRow.from_dict(json.loads(json.dumps(row.to_dict()))) == row


def test_a_case_with_no_answers_keeps_only_its_counts():
    row = summary("forwarded", False, 64, 64, direct=[0.001], front=[])
    assert row.to_dict() == {"prompt": "forwarded", "stream": False, "concurrency": 64,
                             "failed": 64, "requests": 0}
    assert not row.measured and OverheadRow.from_dict(row.to_dict()) == row


def test_the_config_needs_the_old_src_for_the_old_front(tmp_path):
    with pytest.raises(InvalidArgumentError, match="old_src"):
        FrontOverheadConfig(front="old")
    with pytest.raises(InvalidArgumentError, match="at least 1"):
        FrontOverheadConfig(concurrency=())
    assert FrontOverheadConfig().src == SRC and (SRC / "kvnotes" / "__init__.py").is_file()
    assert FrontOverheadConfig(front="old", old_src=tmp_path).src == tmp_path.resolve()


def test_the_servers_import_nothing_of_kvnotes_at_module_level():
    """The file runs under an older checkout's src, which may not have this package."""
    tree = ast.parse(Path(overhead_servers.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert names and not [m for m in names if m.startswith("kvnotes")]


def call(app: Any, path: str, body: bytes) -> tuple[dict[str, Any], bytes]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    asyncio.run(app({"type": "http", "path": path}, receive, send))
    return dict(sent[0]["headers"]), sent[1]["body"]


def test_the_stand_in_upstream_answers_at_once_whole_or_streamed():
    app = overhead_servers.upstream_app()
    headers, body = call(app, "/v1/completions", b'{"stream": false}')
    assert json.loads(body)["choices"][0]["text"] == " ok"
    headers, body = call(app, "/v1/completions", b'{"stream": true}')
    assert headers[b"content-type"] == b"text/event-stream"
    assert body.count(b"data: ") == 4 and body.endswith(b"data: [DONE]\n\n")
    _, body = call(app, "/metrics", b"")
    assert f'block_size="{overhead_servers.BLOCK}"'.encode() in body
