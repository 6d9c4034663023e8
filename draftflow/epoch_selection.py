"""The epoch that serves best (issue 59): each epoch's drafter measured as its epoch ends, the
best one shipped.

A drafter's loss can keep falling while its acceptance falls (a learning rate that overshoots,
too many epochs on little data), so the figure is the one serving reads: the decoding replay's
mean acceptance length (``draftflow.evaluate``) on the first ``samples`` held-out samples, at
K = evaluate.draft_tokens and the temperature the answers were sampled at, where the replay
predicts serving. Each epoch's figure is kept in its folder (``selection.json``), with what it
was measured at, so a rerun of the same training reuses it; the curve, the best epoch and an
early stop go to train/stats.json (``selection``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from draftflow.io import read_json, write_json
from draftflow.sampling import at_temperature

SCORE_FILE = "selection.json"


@dataclass(frozen=True)
class Selection:
    """What an epoch's drafter is measured at: as serving will draft and sample (how many
    held-out samples, and when training stops, are train.selection_samples and
    train.early_stopping_patience)."""

    draft_tokens: int
    max_tokens: int
    sampling: dict  # the effective sampling at the temperature the answers were sampled at

    @classmethod
    def as_served(cls, generation: dict, draft_tokens: int, max_tokens: int) -> Selection:
        """At the temperature generation sampled its answers at (its ``sampling`` record), where
        the decoding replay predicts serving."""
        return cls(draft_tokens, max_tokens, at_temperature(generation, generation["effective"]["temperature"])["effective"])

    @property
    def sampled_at(self) -> float:
        return self.sampling["temperature"]


class EpochScorer:
    """Measures a drafter folder on the first ``samples`` held-out samples (the target's head loaded once)."""

    def __init__(self, selection: Selection, samples: int, target: Path, heldout_view: Path, device: str, attention: str):
        # imported here: draftflow.train imports this module, and evaluate loads torch's models
        from draftflow.evaluate import TargetHead, evaluation_samples
        from draftflow.prompt_sources import HELDOUT

        self.selection, self.view, self.device, self.attention = selection, heldout_view, device, attention
        self.samples = evaluation_samples(heldout_view)[HELDOUT][:samples]
        self.head = TargetHead(target, device)

    def measured_at(self) -> dict:
        """What a figure depends on: the selection and the samples measured."""
        return asdict(self.selection) | {"samples": len(self.samples)}

    def score(self, drafter_dir: Path) -> dict:
        """The drafter's figure, from its folder's ``selection.json`` where it was measured at these settings."""
        from draftflow.evaluate import evaluate
        from draftflow.train import load_drafter

        kept = drafter_dir / SCORE_FILE
        if kept.exists() and (score := read_json(kept))["measured_at"] == self.measured_at():
            return score
        drafter = load_drafter(drafter_dir, self.attention).to(self.device)
        served = {"requests": len(self.samples), "max_tokens": self.selection.max_tokens}
        result = evaluate(drafter, self.head, self.view, self.samples, self.selection.draft_tokens, served,
                          self.selection.sampling, self.selection.sampled_at)  # fmt: skip
        score = {"mean_acceptance_length": result["decoding_replay"]["mean_acceptance_length"],
                 "every_position": result["mean_acceptance_length"], "measured_at": self.measured_at()}  # fmt: skip
        write_json(kept, score)
        return score


def epoch_scorer(selection: Selection, samples: int, target: Path, heldout_view: Path, device: str, attention: str) -> EpochScorer | None:
    """The scorer of ``samples`` held-out samples (train.selection_samples); None for 0: the last epoch ships."""
    return EpochScorer(selection, samples, target, heldout_view, device, attention) if samples else None


def best_epoch(curve: list[dict]) -> int | None:
    """The epoch of the highest figure (the earliest of equals), or None for an empty curve."""
    if not curve:
        return None
    return max(curve, key=lambda point: (point["mean_acceptance_length"], -point["epoch"]))["epoch"]


def patience_spent(curve: list[dict], patience: int | None) -> bool:
    """Whether ``patience`` epochs have ended since the best without beating it."""
    if patience is None or not curve:
        return False
    return curve[-1]["epoch"] - best_epoch(curve) >= patience


def measure_epochs(folders: list[Path], scorer: EpochScorer | None, patience: int | None) -> list[dict]:
    """The curve over the finished epochs' drafters (``folders``, the first epoch's first; a
    point's ``epoch`` counts from 1), up to where ``patience`` ran out; empty without a scorer."""
    curve: list[dict] = []
    for epoch, folder in enumerate(folders):
        if scorer is None or patience_spent(curve, patience):
            break
        score = scorer.score(folder)
        curve.append({"epoch": epoch + 1, "mean_acceptance_length": score["mean_acceptance_length"], "every_position": score["every_position"]})
    return curve


def selection_stats(scorer: EpochScorer | None, curve: list[dict], epochs: int, patience: int | None, loss_history: list[dict]) -> dict:
    """train/stats.json's ``selection``: what was measured, the curve (each epoch's mean loss
    beside its figure), the epoch shipped and whether training stopped early."""
    if scorer is None:
        return {"measured": False, "shipped_epoch": epochs}
    losses: dict[int, list[float]] = {}
    for record in loss_history:  # its epochs count from 0, as the loop's and the Trainer's
        losses.setdefault(record["epoch"] + 1, []).append(record["loss"])
    points = [point | {"loss": sum(losses[point["epoch"]]) / len(losses[point["epoch"]]) if losses.get(point["epoch"]) else None}
              for point in curve]  # fmt: skip
    return {
        "measured": True,
        "figure": "the decoding replay's mean acceptance length on held-out samples",
        "samples": len(scorer.samples),
        "draft_tokens": scorer.selection.draft_tokens,
        "temperature": scorer.selection.sampled_at,
        "curve": points,
        "shipped_epoch": best_epoch(curve),
        "last_epoch": curve[-1]["epoch"] if curve else None,
        "stopped_early": bool(curve) and curve[-1]["epoch"] < epochs,
        "patience": patience,
    }


def describe(selection: dict) -> str:
    """One line on the drafter shipped (train/stats.json's ``selection``), for the train log and the model card."""
    if not selection.get("measured"):
        return "the last epoch's drafter (train.selection_samples 0: no epoch measured)"
    best = next(point for point in selection["curve"] if point["epoch"] == selection["shipped_epoch"])
    last = selection["curve"][-1]
    line = (f"epoch {best['epoch']}'s drafter: mean acceptance length {best['mean_acceptance_length']:.3f} along the "
            f"decoding replay of {selection['samples']} held-out samples at K {selection['draft_tokens']}, temperature "
            f"{selection['temperature']:g}; the last epoch measured ({last['epoch']}) {last['mean_acceptance_length']:.3f}")  # fmt: skip
    if selection["stopped_early"]:
        line += f"; training stopped after {selection['patience']} epoch(s) without a better one"
    return line


def curve_lines(selection: dict) -> list[str]:
    """The report's and the card's table of the curve: each epoch's figure and mean loss, the shipped one marked."""
    if not selection.get("measured"):
        return []
    rows = [f"| {point['epoch']}{' (shipped)' if point['epoch'] == selection['shipped_epoch'] else ''} | "
            f"{point['mean_acceptance_length']:.3f} | {point['every_position']:.3f} | "
            f"{'' if point['loss'] is None else format(point['loss'], '.3f')} |" for point in selection["curve"]]  # fmt: skip
    return ["| epoch | τ, decoding replay | τ, every position | mean loss |", "| --- | --- | --- | --- |", *rows]


def plot_curve(selection: dict, output: Path) -> None:
    """The replayed acceptance per epoch beside the loss, the shipped epoch marked."""
    from draftflow.plots import pyplot, save_png

    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6, 4))
    if not selection.get("measured"):
        axis.text(0.5, 0.5, "no epoch measured (train.selection_samples 0):\nthe last epoch shipped", ha="center", va="center")
        axis.set_axis_off()
        save_png(figure, output)
        return
    epochs = [point["epoch"] for point in selection["curve"]]
    axis.plot(epochs, [point["mean_acceptance_length"] for point in selection["curve"]], "o-", color="C0", label="τ, decoding replay")
    shipped = next(point for point in selection["curve"] if point["epoch"] == selection["shipped_epoch"])
    axis.plot([shipped["epoch"]], [shipped["mean_acceptance_length"]], "*", color="C3", markersize=14, label="shipped")
    axis.set(xlabel="epoch", ylabel="mean acceptance length τ", xticks=epochs,
             title=f"Held-out acceptance per epoch ({selection['samples']} samples, K {selection['draft_tokens']})")  # fmt: skip
    losses = [(point["epoch"], point["loss"]) for point in selection["curve"] if point["loss"] is not None]
    if losses:
        loss_axis = axis.twinx()
        loss_axis.plot(*zip(*losses), "s--", color="C1", label="mean training loss")
        loss_axis.set_ylabel("mean training loss")
        loss_axis.legend(loc="lower right", fontsize="small")
    axis.legend(loc="upper left", fontsize="small")
    save_png(figure, output)
