"""The README's promises: its test command is what CI runs, and its Python tour runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    ci = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()
          if line.strip() and not line.startswith("#") and not line.startswith("set ")
          and not line.startswith("cd ")]
    assert ci == ["make test"]


@pytest.mark.real
def test_readme_python_tour_runs(tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    block = block.replace("/tmp/order.safetensors", str(tmp_path / "order.safetensors"))
    exec(compile(block, "README.md", "exec"), {})
