"""The epoch that serves best is shipped (issue 59): each epoch's drafter is measured on held-out
samples as its epoch ends, training stops once ``early_stopping_patience`` epochs pass without a
better one, and the best is what ``train`` writes. On the demo's views, untrained drafter and
target, through ``train_drafter``: the CPU loop, and the Trainer's path with its stand-in
(tests/trainer_stand_in.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from safetensors.torch import load_file

from draftflow.config import schema, with_defaults
from draftflow.epoch_selection import EpochScorer, Selection
from draftflow.evaluate import GREEDY, evaluate
from draftflow.train import TrainSettings, cpu_epoch_folder, load_drafter, train_drafter
from tests.conftest import REPO, demo_config
from tests.test_training_key import gpu_settings, same

pytestmark = pytest.mark.slow

SELECTION = Selection(draft_tokens=3, max_tokens=256, sampling=GREEDY)


def scorer(demo_run: Path, samples: int = 16) -> EpochScorer:
    target = demo_run.parents[1] / demo_config()["target"]["path"]
    return EpochScorer(SELECTION, samples, target, demo_run / "training_data/heldout", "cpu", "sdpa")


def cpu_settings(**changes) -> TrainSettings:
    """The demo's training settings as rules/common.smk's train_settings takes them (16 samples measured each epoch)."""
    section = {key: value for key, value in with_defaults(demo_config(), schema())["train"].items() if key != "heldout_fraction"}
    return replace(TrainSettings(**section, seed=0, device="cpu"), **changes)


def weights(folder: Path) -> dict:
    return load_file(folder / "model.safetensors")


def test_training_stops_once_an_epoch_fails_to_beat_the_best_and_ships_the_best_epoch(demo_run, tmp_path):
    """At 5 times the demo's learning rate the replayed acceptance levels off within 12 epochs;
    with a patience of 1 the first epoch that does not beat the best ends training, so the last
    epoch trained is not the best, and the best is shipped."""
    settings = cpu_settings(lr=0.01, epochs=12, early_stopping_patience=1)
    work, output = tmp_path / "work", tmp_path / "drafter"
    stats = train_drafter(demo_run / "drafter_untrained", demo_run / "training_data/train", settings, work, output, scorer(demo_run))
    selection = stats["selection"]
    curve = {point["epoch"]: point["mean_acceptance_length"] for point in selection["curve"]}
    best, last = selection["shipped_epoch"], selection["last_epoch"]
    assert selection["stopped_early"] and last == best + 1 < 12 and list(curve) == list(range(1, last + 1))
    assert curve[last] <= curve[best] == max(curve.values())
    (key_dir,) = work.iterdir()
    # training itself stopped there: no step and no drafter of a later epoch
    assert {record["epoch"] + 1 for record in stats["loss_history"]} == set(curve) and len(list((key_dir / "epochs").iterdir())) == last
    assert same(weights(output), weights(cpu_epoch_folder(key_dir, best - 1)))
    assert not same(weights(output), weights(cpu_epoch_folder(key_dir, last - 1)))
    # the figure is the decoding replay's on those samples, as evaluate measures a drafter
    measured = scorer(demo_run)
    replayed = evaluate(load_drafter(output, "sdpa"), measured.head, measured.view, measured.samples, 3,
                        {"requests": 16, "max_tokens": 256})["decoding_replay"]["mean_acceptance_length"]  # fmt: skip
    assert replayed == pytest.approx(curve[best], abs=1e-9)
    # a rerun of the same key trains no further than the stop, and reuses each epoch's figure
    figures = {path: path.stat().st_mtime_ns for path in key_dir.glob("epochs/*/selection.json")}
    assert len(figures) == last
    again = train_drafter(demo_run / "drafter_untrained", demo_run / "training_data/train", settings, work, tmp_path / "again", scorer(demo_run))
    assert again["selection"] == selection and again["steps"] == stats["steps"]
    assert {path: path.stat().st_mtime_ns for path in key_dir.glob("epochs/*/selection.json")} == figures
    assert same(weights(tmp_path / "again"), weights(output))


def test_the_trainer_is_stopped_between_epochs_once_patience_runs_out(demo_run, tmp_path, monkeypatch):
    """The stand-in's epochs are measured as it writes them; the drafters it makes (its weights
    only drift) level off at once, so an epoch soon fails to beat the best and the Trainer is
    stopped: far short of its 1,000 epochs, the best epoch's checkpoint shipped, and a rerun
    starts no Trainer."""
    from draftflow import train

    monkeypatch.setattr(train, "TRAINER_LAUNCH", "tests.trainer_stand_in")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("STAND_IN_STEP_SECONDS", "0.05")
    settings = replace(gpu_settings(selection_samples=4, early_stopping_patience=1), epochs=1000)
    work = tmp_path / "work"
    stats = train_drafter(demo_run / "drafter_untrained", demo_run / "training_data/train", settings, work, tmp_path / "drafter",
                          scorer(demo_run, samples=4))  # fmt: skip
    selection = stats["selection"]
    best, last = selection["shipped_epoch"], selection["last_epoch"]
    assert selection["stopped_early"] and last == best + 1
    (key_dir,) = work.iterdir()
    assert same(weights(tmp_path / "drafter"), weights(key_dir / f"checkpoints/{best - 1}"))
    assert not same(weights(tmp_path / "drafter"), weights(key_dir / f"checkpoints/{last - 1}"))
    trained_epochs = {json.loads(line)["epoch"] for line in (key_dir / "metrics.jsonl").read_text().splitlines()}
    assert max(trained_epochs) < 100  # stopped, not run to its end
    records = (key_dir / "metrics.jsonl").read_text()
    again = train_drafter(demo_run / "drafter_untrained", demo_run / "training_data/train", settings, work, tmp_path / "again",
                          scorer(demo_run, samples=4))  # fmt: skip
    assert (key_dir / "metrics.jsonl").read_text() == records and again["selection"]["curve"] == selection["curve"]


def test_without_selection_the_last_epoch_ships(demo_run, tmp_path):
    settings = cpu_settings(epochs=2, selection_samples=0)
    stats = train_drafter(demo_run / "drafter_untrained", demo_run / "training_data/train", settings, tmp_path / "work", tmp_path / "drafter")
    (key_dir,) = (tmp_path / "work").iterdir()
    assert stats["selection"] == {"measured": False, "shipped_epoch": 2}
    assert same(weights(tmp_path / "drafter"), weights(cpu_epoch_folder(key_dir, 1)))
