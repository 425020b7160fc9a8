"""Every committed serving result bundle under docs/results/ still reads back, and its report
renders from its JSON exactly as committed (bundles written before the report's wording or
columns last changed render with the current wording: for those, the title and every TTFT
figure are compared)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvnotes_bench.serving import agent_traffic_report, skills_report, soak_report
from kvnotes_bench.serving import report as erratum_report

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results" / "serve-bench"


def _bundles(json_name: str, workload: str | None) -> list[Path]:
    return sorted(p.parent for p in RESULTS.glob(f"*/{json_name}")
                  if json.loads(p.read_text()).get("workload") == workload)


# written by an earlier wording of the report: the figures are compared, not the text
EARLIER_WORDING = {"skills-repaired-smollm2", "block-128", "block-64", "matrix-b32-c1",
                   "matrix-b32-c16", "matrix-b32-c16-1k4k", "matrix-b32-c16-8k",
                   "matrix-b32-c4-1k4k", "matrix-b32-c4-8k", "status-b32-1k4k", "status-b32-8k"}
SECONDS = re.compile(r"\b\d+\.\d{3}s\b")

SKILLS = _bundles("results.json", "skills")
SOAK = _bundles("result.json", "soak")
ERRATUM = _bundles("result.json", None)
AGENT = _bundles("result.json", "agent")


def _check(folder: Path, rendered: str) -> None:
    committed = (folder / "report.md").read_text()
    if folder.name in EARLIER_WORDING:
        assert rendered.splitlines()[0] == committed.splitlines()[0]
        assert SECONDS.findall(committed) and SECONDS.findall(rendered) == SECONDS.findall(committed)
    else:
        assert rendered == committed


def test_every_committed_bundle_is_covered():
    assert len(SKILLS) >= 6 and len(SOAK) >= 1 and len(ERRATUM) >= 15
    assert {p.name for p in RESULTS.iterdir() if p.is_dir()} == {
        p.name for p in [*SKILLS, *SOAK, *ERRATUM, *AGENT]}
    assert EARLIER_WORDING <= {p.name for p in [*SKILLS, *ERRATUM]}


@pytest.mark.parametrize("folder", SKILLS, ids=lambda p: p.name)
def test_skills_report_renders_as_committed(folder):
    data = json.loads((folder / "results.json").read_text())
    _check(folder, skills_report.markdown(data))


@pytest.mark.parametrize("folder", SOAK, ids=lambda p: p.name)
def test_soak_report_renders_as_committed(folder):
    data = json.loads((folder / "result.json").read_text())
    _check(folder, soak_report.markdown(data))


@pytest.mark.parametrize("folder", ERRATUM, ids=lambda p: p.name)
def test_erratum_report_renders_as_committed(folder):
    data = json.loads((folder / "result.json").read_text())
    _check(folder, erratum_report.report_markdown(data))


@pytest.mark.parametrize("folder", AGENT, ids=lambda p: p.name)
def test_agent_report_renders_as_committed(folder):
    data = json.loads((folder / "result.json").read_text())
    _check(folder, agent_traffic_report.markdown(data))
