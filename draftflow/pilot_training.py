"""The pilot rule's work (issue 59): drafters on nested prefixes of a run's training view, each
trained with the run's recipe and measured as the evaluation's decoding replay measures, then
the record ``draftflow.pilot`` writes.

The fractions train at matched epochs, not matched steps: each trains with the run's own
recipe (train.epochs, its learning rate and schedule, the best epoch shipped as the run's
drafter is), as a user trains each size, so the curve says what the same recipe buys on more
data; at matched steps a small fraction would pass over its few samples many times more than
the run does, and the curve would mix data with repetition. The largest fraction, 1, is the
run's own drafter. The held-out requests are those the run's decoding replay walks
(evaluate.serve_check_requests), at the temperature the answers were sampled at, so the last
point is the evaluation's own figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from draftflow.io import read_json, write_json
from draftflow.pilot import pilot_result, plot_pilot, summary_lines


@dataclass(frozen=True)
class ViewSource:
    """What train_views builds its views from: the prepared dataset, the extraction's summary and
    its split (split.json: the training rows, in the training view's order)."""

    dataset: Path
    hidden_states: Path
    split: Path


def fraction_rows(train_rows: int, fractions: list[float]) -> list[int]:
    """Rows each fraction trains on (at least one each), smallest first, without repeats."""
    return sorted({max(1, round(fraction * train_rows)) for fraction in fractions})


def replayed_requests(drafter, head, heldout_view: Path, samples: list, selection) -> tuple[list[int], list[int]]:
    """Drafts and accepted tokens per held-out request along the decoding replay, as the
    evaluation counts them (``draftflow.evaluate.measure``) at the selection's K and sampling."""
    from draftflow.evaluate import measure

    k = selection.draft_tokens
    acceptance = measure(drafter, head, heldout_view, samples, [k], len(samples), selection.max_tokens,
                         selection.sampling, selection.sampled_at)[""]  # fmt: skip
    steps = acceptance.replayed[k]
    return [int(s.numel()) for s in steps], [int(s.sum()) for s in steps]


def train_fractions(init_dir: Path, views: ViewSource, trained: Path, settings, scorer, work_dir: Path,
                    fractions: list[float]) -> dict[int, Path]:  # fmt: skip
    """Each fraction's drafter folder by its training rows: the smaller ones trained here (each on
    a view of the first rows of the training view, as train_views builds it, made again each
    time, so that edited data or settings train anew while a finished training key resumes at
    its end), the whole view's the run's."""
    from draftflow.train import train_drafter
    from draftflow.training_data import build_view, training_rows

    train_rows = training_rows(views.split)
    drafters = {}
    for rows in fraction_rows(len(train_rows), fractions):
        if rows == len(train_rows):
            drafters[rows] = trained
            continue
        folder = work_dir / f"rows-{rows}"
        build_view(views.dataset, views.hidden_states, train_rows[:rows], folder / "view")
        print(f"pilot: {rows} of {len(train_rows)} training samples")
        train_drafter(init_dir, folder / "view", settings, folder / "work", folder / "drafter", scorer)
        drafters[rows] = folder / "drafter"
    return drafters


def run_pilot(init_dir: Path, views: ViewSource, heldout_view: Path, trained: Path, target: Path, generation_stats: Path,
              settings: dict, selection: dict, requests: int, num_samples: int, pilot: dict, work_dir: Path,
              output: Path, plot: Path) -> dict:  # fmt: skip
    """The pilot rule: the fractions' drafters (``settings``: TrainSettings' fields), each measured on
    the first ``requests`` held-out samples as the evaluation's replay is, the fit, pilot.json and its plot."""
    from draftflow.epoch_selection import Selection, epoch_scorer
    from draftflow.evaluate import TargetHead, evaluation_samples
    from draftflow.pilot_fit import Replayed
    from draftflow.prompt_sources import HELDOUT
    from draftflow.train import TrainSettings, load_drafter

    trainer = TrainSettings(**settings)
    served = Selection.as_served(read_json(generation_stats)["sampling"], **selection)
    scorer = epoch_scorer(served, trainer.selection_samples, target, heldout_view, trainer.device, trainer.attention)
    drafters = train_fractions(init_dir, views, trained, trainer, scorer, work_dir, pilot["fractions"])
    head = scorer.head if scorer else TargetHead(target, trainer.device)
    samples = evaluation_samples(heldout_view)[HELDOUT][:requests]
    points = []
    for rows, folder in drafters.items():
        drafter = load_drafter(folder, trainer.attention).to(trainer.device)
        points.append(Replayed(rows, *replayed_requests(drafter, head, heldout_view, samples, served)))
    result = pilot_result(points, max(drafters) / num_samples, num_samples, {**pilot, "seed": settings["seed"]})
    write_json(output, result)
    plot_pilot(result, plot)
    print("\n".join(summary_lines(result)))
    return result
