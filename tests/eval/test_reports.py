"""The report bundle writer (eval/reports): JSON, report.md and a chart, written atomically."""

from __future__ import annotations

import json

from kvnotes.eval.reports import write_bundle


def test_write_bundle(tmp_path):
    drawn = []

    def plot(path):
        drawn.append(path)
        path.write_bytes(b"\x89PNG")

    out = tmp_path / "run"
    paths = write_bundle(out, {"a": 1, "t": (1, 2)}, report="# hi\n", json_name="r.json",
                         plot_name="c.png", plot=plot)
    assert paths == {"json": out / "r.json", "report": out / "report.md", "plot": out / "c.png"}
    assert json.loads(paths["json"].read_text()) == {"a": 1, "t": [1, 2]}
    assert paths["report"].read_text() == "# hi\n" and paths["plot"].read_bytes() == b"\x89PNG"
    assert drawn[0].suffix == ".png"  # matplotlib picks the format by the suffix
    assert sorted(p.name for p in out.iterdir()) == ["c.png", "r.json", "report.md"]  # no temp


def test_write_bundle_without_a_chart(tmp_path):
    paths = write_bundle(tmp_path, [1], report="", json_name="x.json", plot_name="x.png")
    assert paths["json"].exists() and not paths["plot"].exists()
