"""The documentation's layout holds: guides in docs/guide, benchmark pages in docs/bench, results as
an index over area pages, every relative link resolving, and no measured figure in a docstring.

Measured figures live in docs/results (each with its date, command, machine and load); a docstring
points there instead, so a rerun changes one page and never leaves a stale number in the code.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SRC = ROOT / "src" / "kvnotes"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

# What a measured result looks like in prose. Each pattern is narrow enough that explanations of
# units, shapes and configuration constants ("3x the layer's KV", "5 s", "3.4% at nice 15") pass.
_MODEL = r"(?:SmolLM2|Gemma|Qwen)"
FIGURES = {
    "a ratio with decimals": r"\b\d+\.\d+x\b",
    "a time in ms or us": r"\b\d+(?:\.\d+)?\s?(?:ms|us|µs)\b",
    "a throughput": r"\b\d+(?:\.\d+)?\s?(?:tokens/s|requests/s|GB/s|MB/s)\b",
    "a cosine or KL figure": r"\b(?:cos|cosine|KL)\b[^\n]{0,30}?\b\d\.\d{3,}",
    "a share beside a model": rf"{_MODEL}[^.;\n]*?\b\d+(?:\.\d+)?%|\b\d+(?:\.\d+)?%[^.;\n]*?{_MODEL}",
    "a count of cases": r"\b\d+(?:/| of )\d+\s+(?:cases|decisions|requests|answers|episodes)\b",
    "a figure 'measured on'": r"\bmeasured (?:on|at|with)\b[^.\n]*?\d",
    "a ratio in words": r"\babout (?:twice|half|a third|\d+(?:\.\d+)?\s?%)|\bby (?:a third|half)\b"
                        r"|\b\d+(?:\.\d+)? times (?:faster|slower)\b",
    "a duration 'about N minutes'": r"\babout \d+(?:\.\d+)?\s?(?:minutes|min|seconds|hours)\b",
}
FIGURE = re.compile("|".join(f"(?:{p})" for p in FIGURES.values()))


def measured_figures(text: str) -> list[str]:
    """The measured-looking phrases in ``text`` (read with its line breaks as spaces)."""
    return [m.group(0) for m in FIGURE.finditer(re.sub(r"\s+", " ", text))]


@pytest.mark.parametrize("phrase", [
    "overhead 1.3-2.4 ms at concurrency 1", "4.75x below prefix caching", "min cos 0.994",
    "logit cosine at least 0.9940", "kept in 92% (SmolLM2) and 95% (Gemma 3) of cases",
    "measured on SmolLM2-135M it is about 40% of a forward", "23/24 cases", "13 of 24 cases",
    "about twice the splice error", "delays first tokens by a third", "about 3 minutes",
    "about 70 entries (minutes once per model; about\n            half the splice error)",
    "6.0 GB/s at 4k", "2.2 tokens/s"])
def test_the_figure_patterns_catch_measured_results(phrase: str):
    assert measured_figures(phrase), phrase


@pytest.mark.parametrize("phrase", [
    "the copy (3x the layer's KV for SmolLM2, every layer)", "longer than the idle 5 s",
    "(busy_core_share: 3.4% at the default 15)", "with 95% CIs", "under 1% for the bundled models",
    "repair budgets 0, 2.5%, 5%, 10% of the spliced tokens", ">>> AgentConfig(guard=0.25).guard",
    "1/5/15-minute load average", "measured on a busy machine say so", "half the size"])
def test_the_figure_patterns_pass_explanations(phrase: str):
    assert measured_figures(phrase) == [], phrase


def docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, docstring) of the module and of every class and function in ``path``."""
    tree = ast.parse(path.read_text("utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text:
                found.append((node.body[0].lineno, text))
    return found


def test_no_docstring_holds_a_measured_figure():
    offenders = [f"{path.relative_to(ROOT)}:{line}: {figure!r}"
                 for path in sorted(SRC.rglob("*.py")) for line, text in docstrings(path)
                 for figure in measured_figures(text)]
    assert offenders == [], ("measured figures belong in docs/results (a docstring points there):\n"
                             + "\n".join(offenders))


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def links(page: Path) -> list[str]:
    """The relative link targets of ``page`` outside code blocks (no scheme, no mail)."""
    text = FENCE.sub("", page.read_text("utf-8"))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    for line in FENCE.sub("", page.read_text("utf-8")).splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            s = slug(m.group(1))
            seen[s] = seen.get(s, -1) + 1
    return {s if n == 0 else f"{s}-{n}" for s, count in seen.items() for n in range(count + 1)}


def test_the_pages_have_links():
    assert sum(len(links(page)) for page in PAGES) > 100


def test_every_relative_link_resolves_to_a_file():
    missing = []
    for page in PAGES:
        for target in links(page):
            path = target.partition("#")[0]
            if path and not (page.parent / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {target}")
    assert missing == []


def test_every_anchor_names_a_heading():
    broken = []
    for page in PAGES:
        for target in links(page):
            path, _, anchor = target.partition("#")
            file = (page.parent / path) if path else page
            if anchor and file.suffix == ".md" and file.exists() and anchor not in anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def test_guides_benchmarks_and_results_sit_in_their_own_folders():
    assert sorted(p.name for p in DOCS.glob("*.md")) == ["design.md", "results.md"]
    assert (DOCS / "guide" / "serving.md").is_file() and (DOCS / "guide" / "deployment.md").is_file()
    assert (DOCS / "bench" / "README.md").is_file() and (DOCS / "bench" / "tools.md").is_file()
    assert (DOCS / "results" / "archive.md").is_file()


def test_the_results_index_links_every_area_page_and_each_claim_to_one():
    index = DOCS / "results.md"
    targets = {t.partition("#")[0] for t in links(index)}
    areas = sorted((DOCS / "results" / "areas").glob("*.md"))
    assert areas and all(f"results/areas/{a.name}" in targets for a in areas)
    text = index.read_text("utf-8")
    claims = text[text.index("## Claims"):]
    rows = [r for r in claims.splitlines() if r.startswith("| ") and not r.startswith("| claim ")]
    assert len(rows) >= 30
    assert all("](results/areas/" in r for r in rows), [r[:80] for r in rows if "](results/areas/" not in r]


def test_the_readme_says_how_to_pip_install_from_a_checkout():
    readme = (ROOT / "README.md").read_text("utf-8")
    assert "pip install -e ." in readme
    assert 'pip install -e ".[dev]"' in readme
