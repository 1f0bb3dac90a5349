"""PNG line plots of benchmark series (matplotlib, no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

Series = Mapping[str, Sequence[tuple[float, float]]]  # name -> (x, y) points


def line_plot(path: Path, title: str, xlabel: str, ylabel: str, series: Series, log_x: bool = False) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    xs: set[float] = set()
    for name, points in series.items():
        ordered = sorted(p for p in points if p[1] == p[1])  # NaN (skipped) points are left out
        xs.update(x for x, _ in ordered)
        if ordered:
            axes.plot([x for x, _ in ordered], [y for _, y in ordered], marker="o", label=name)
    if log_x:
        axes.set_xscale("log", base=2)
    axes.set_xticks(sorted(xs), [f"{x:g}" for x in sorted(xs)])
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path
