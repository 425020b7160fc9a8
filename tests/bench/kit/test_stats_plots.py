"""The kit's one percentile, its bootstrap interval and the charts' figure handling."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvnotes_bench.kit.plots import cdf, grouped_bars, panels
from kvnotes_bench.kit.stats import bootstrap_ci, median, percentile


def test_percentile_is_numpys_linear_definition():
    xs = [5.0, 1.0, 2.0, 3.0, 4.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile(xs, 90) == pytest.approx(9.1)  # nearest rank would give 9.0
    assert percentile([1.0, math.nan, 3.0], 50) == 2.0  # NaNs dropped
    assert percentile([], 50) is None and median([]) is None
    assert median([3.0, 1.0, 2.0, 10.0]) == 2.5
    with pytest.raises(ValueError, match="percentile must lie in"):
        percentile(xs, 101)


def test_bootstrap_ci_is_seeded_and_brackets_the_statistic():
    xs = [0.11, 0.12, 0.10, 0.30, 0.13, 0.12, 0.11, 0.14]
    lo, hi = bootstrap_ci(xs) or (math.nan, math.nan)
    assert lo <= float(np.mean(xs)) <= hi
    assert bootstrap_ci(xs) == (lo, hi)  # the same values, the same interval
    mlo, mhi = bootstrap_ci(xs, np.median) or (math.nan, math.nan)
    assert min(xs) <= mlo <= float(np.median(xs)) <= mhi <= max(xs)
    assert bootstrap_ci([0.1]) is None and bootstrap_ci([]) is None


def test_panels_save_a_png_and_close_the_figure_even_when_drawing_fails(tmp_path):
    import matplotlib.pyplot as plt

    before = len(plt.get_fignums())
    path = tmp_path / "ok.png"
    with panels(path, 2, size=(6, 3), title="t") as (ax, bx):
        assert cdf(ax, [0.2, 0.1]) and not cdf(ax, [])
        grouped_bars(bx, ["c1", "c4"], {"redis": [1.0, 2.0], "folder": [1.5, 2.5]})
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(RuntimeError), panels(tmp_path / "bad.png") as (ax,):
        raise RuntimeError("drawing failed")
    assert not (tmp_path / "bad.png").exists()
    assert len(plt.get_fignums()) == before
