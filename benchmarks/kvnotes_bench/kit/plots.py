"""The bench's charts: one way to open a figure and save it, and the two shapes the reports
draw again and again (a distribution's CDF, bars side by side).

Every report draws inside :func:`panels`, which picks the non-interactive backend (the
benchmarks run on servers without a display), lays out a row of panels, and saves the PNG at
one resolution whatever happens inside (the figure is closed even when drawing fails).

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "x.png"
    >>> with panels(path, 2, size=(8, 3), title="two panels") as (ax, bx):
    ...     cdf(ax, [0.3, 0.1, 0.2], label="ttft")
    ...     grouped_bars(bx, ["c1", "c4"], {"redis": [1.0, 2.0], "folder": [1.5, 2.5]})
    True
    >>> path.exists()
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

DPI = 120


@contextmanager
def panels(path: str | Path, n: int = 1, *, size: tuple[float, float] = (6.0, 4.0),
           title: str | None = None, title_size: float | None = None) -> Iterator[list[Any]]:
    """A figure of ``size`` inches holding a row of ``n`` panels (matplotlib ``Axes``), saved
    to ``path`` as a PNG when the block ends; ``title`` goes above them all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(1, n), figsize=size, squeeze=False)
    try:
        yield list(axes[0])
        if title is not None:
            fig.suptitle(title, fontsize=title_size)
        fig.tight_layout()
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)


def cdf(ax: Any, values: Iterable[float], **style: Any) -> bool:
    """The empirical CDF of ``values`` as a step line on ``ax`` (``style``: matplotlib's line
    keywords); False, and nothing drawn, when there are none."""
    xs = sorted(values)
    if not xs:
        return False
    ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", **style)
    return True


def grouped_bars(ax: Any, labels: Sequence[str], series: Mapping[str, Sequence[float]], *,
                 width: float = 0.8, **style: Any) -> None:
    """One group of bars per label, one bar per series in each (side by side, ``width`` the
    whole group's), the labels under the groups; each bar carries its series' name as label."""
    k = max(1, len(series))
    for j, (name, values) in enumerate(series.items()):
        offset = (j - (k - 1) / 2) * width / k
        ax.bar([i + offset for i in range(len(labels))], values, width / k, label=name, **style)
    ax.set_xticks(range(len(labels)), labels)


def log_x(ax: Any) -> None:
    """A log time axis without labels on its minor ticks (they crowd on a short range)."""
    import matplotlib.ticker

    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
