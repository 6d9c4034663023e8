"""Stage 4: the draft vocabulary (d2t/t2d) and how much of the data it covers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

from draftflow.io import atomic_path, write_json
from draftflow.plots import pyplot, save_png


def coverage_curve(token_freq: dict[int, int], sizes: list[int]) -> dict[int, float]:
    """Fraction of loss-masked token occurrences covered by the top-K tokens."""
    counts = np.sort(np.fromiter(token_freq.values(), dtype=np.int64))[::-1]
    cumulative = np.cumsum(counts)
    total = cumulative[-1]
    return {k: float(cumulative[min(k, len(counts)) - 1] / total) for k in sorted(sizes)}


def save_npy(path: Path, array: np.ndarray) -> None:
    with atomic_path(path) as tmp, tmp.open("wb") as out:
        np.save(out, array)


def build_vocab_map(
    token_freq_path: Path,
    target_vocab_size: int,
    draft_vocab_size: int,
    coverage_sizes: list[int],
    *,
    d2t_output: Path,
    t2d_output: Path,
    coverage_output: Path,
) -> dict:
    token_freq = torch.load(token_freq_path, weights_only=True)
    d2t, t2d = build_vocab_mappings_from_distribution(
        token_freq, draft_vocab_size, target_vocab_size
    )
    curve = coverage_curve(token_freq, [*coverage_sizes, draft_vocab_size])
    summary = {
        "draft_vocab_size": draft_vocab_size,
        "target_vocab_size": target_vocab_size,
        "coverage": curve[draft_vocab_size],
        "distinct_tokens_seen": len(token_freq),
        "token_occurrences": int(sum(token_freq.values())),
        "curve": {str(k): v for k, v in curve.items()},
    }
    save_npy(d2t_output, d2t.numpy())
    save_npy(t2d_output, t2d.numpy())
    write_json(coverage_output, summary)
    return summary


def plot_coverage(summary: dict, output: Path) -> None:
    plt = pyplot()
    curve = sorted((int(k), 100 * v) for k, v in summary["curve"].items())
    sizes, values = zip(*curve, strict=True)
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(sizes, values, marker="o")
    axis.axvline(summary["draft_vocab_size"], color="grey", linestyle="--")
    axis.annotate(
        f"{100 * summary['coverage']:.1f}% at K={summary['draft_vocab_size']}",
        (summary["draft_vocab_size"], 100 * summary["coverage"]),
        textcoords="offset points", xytext=(8, -14),
    )  # fmt: skip
    axis.set(
        xscale="log",
        xlabel="draft vocabulary size K",
        ylabel="loss-masked tokens covered (%)",
        title="Draft vocabulary coverage",
    )
    axis.set_xticks(sizes, [f"{k:,}" for k in sizes])
    axis.minorticks_off()
    axis.grid(alpha=0.3)
    save_png(figure, output)
