"""Matplotlib without a display, and atomic PNG writes."""

from __future__ import annotations

from pathlib import Path

from draftflow.io import atomic_path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(figure, output: Path) -> None:
    figure.tight_layout()
    with atomic_path(output) as tmp:
        figure.savefig(tmp, format="png", dpi=120)
    pyplot().close(figure)
