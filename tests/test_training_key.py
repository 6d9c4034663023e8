"""Training's work folder belongs to training's key (issue 57): a rerun after an edit of the
settings or the data never resumes from another key's checkpoints, and a rerun of the same key
after a kill resumes from its own. On the demo's views and untrained drafter, through
``train_drafter`` with speculators' Trainer replaced by a stand-in of its save-path contract
(tests/trainer_stand_in.py: the Trainer needs an accelerator)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from speculators.train.config import TrainConfig

from draftflow import train
from draftflow.config import schema, with_defaults
from draftflow.train import TrainSettings, checkpoint_freq, train_drafter, trainer_flags, trainer_steps_per_epoch
from draftflow.training_data import view_identity
from tests.conftest import REPO, demo_config

pytestmark = pytest.mark.slow


@pytest.fixture
def stand_in_trainer(monkeypatch):
    monkeypatch.setattr(train, "TRAINER_LAUNCH", "tests.trainer_stand_in")
    monkeypatch.setenv("PYTHONPATH", str(REPO))


def gpu_settings(**changes) -> TrainSettings:
    """The demo's training settings as a CUDA run would take them, one GPU, 2 epochs."""
    section = {key: value for key, value in with_defaults(demo_config(), schema())["train"].items() if key != "heldout_fraction"}
    return replace(TrainSettings(**section, seed=0, device="cuda"), gpus=1, epochs=2, **changes)  # as rules/common.smk's train_settings


def trained(demo_run: Path, work: Path, output: Path, settings: TrainSettings) -> tuple[dict, dict]:
    """(the shipped drafter's weights, the training stats)."""
    stats = train_drafter(demo_run / "drafter_untrained", demo_run / "training_data/train", settings, work, output)
    return load_file(output / "model.safetensors"), stats


def same(first: dict, second: dict) -> bool:
    return first.keys() == second.keys() and all(torch.equal(first[name], second[name]) for name in first)


def test_an_edited_learning_rate_trains_again_from_the_untrained_drafter(demo_run, tmp_path, stand_in_trainer):
    settings = gpu_settings()
    old, _ = trained(demo_run, tmp_path / "work", tmp_path / "old", settings)
    edited = replace(settings, lr=settings.lr * 2)
    new, stats = trained(demo_run, tmp_path / "work", tmp_path / "new", edited)
    clean, _ = trained(demo_run, tmp_path / "clean-work", tmp_path / "clean", edited)
    assert not same(new, old) and same(new, clean)  # trained from the untrained drafter, not from old's checkpoints
    assert stats["steps"] == 2 * trainer_steps_per_epoch(demo_run / "training_data/train", edited)
    assert [path.name for path in (tmp_path / "work").iterdir()] == [train.training_key(demo_run / "drafter_untrained",
                                                                                         demo_run / "training_data/train", edited)]  # fmt: skip


def test_a_rerun_of_the_same_key_after_a_kill_resumes_from_its_last_checkpoint(demo_run, tmp_path, stand_in_trainer, monkeypatch):
    view = demo_run / "training_data/train"
    steps = trainer_steps_per_epoch(view, gpu_settings())
    settings = gpu_settings(checkpoint_every_steps=max(1, steps // 2))  # checkpoints inside each epoch
    monkeypatch.setenv("STAND_IN_DIE_AFTER_STEPS", str(steps + steps // 2 + 1))  # in the second epoch, past its checkpoint
    with pytest.raises(subprocess.CalledProcessError):
        trained(demo_run, tmp_path / "work", tmp_path / "killed", settings)
    monkeypatch.delenv("STAND_IN_DIE_AFTER_STEPS")
    resumed, stats = trained(demo_run, tmp_path / "work", tmp_path / "resumed", settings)
    uninterrupted, _ = trained(demo_run, tmp_path / "clean-work", tmp_path / "uninterrupted", settings)
    assert same(resumed, uninterrupted)
    log = [json.loads(line) for line in next((tmp_path / "work").glob("*/metrics.jsonl")).read_text().splitlines()]
    # the killed run's steps, then the resumed run's from its last checkpoint on (one step redone)
    assert [entry["step"] for entry in log] == [*range(steps + steps // 2 + 1), *range(steps + steps // 2, 2 * steps)]
    assert stats["steps"] == 2 * steps


# Training as a Snakemake job runs it, in a process group of its own (the test's to kill).
TRAINING_JOB = """
import sys
from dataclasses import replace
from pathlib import Path
from draftflow import train
from tests.test_training_key import gpu_settings, trained
train.TRAINER_LAUNCH = "tests.trainer_stand_in"
trained(Path(sys.argv[1]), Path(sys.argv[2]) / "work", Path(sys.argv[2]) / "killed", replace(gpu_settings(), epochs=1000))
"""


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_a_kill_of_the_training_jobs_process_group_stops_the_trainers_workers(demo_run, tmp_path, stand_in_trainer, monkeypatch):
    """torchrun starts its workers in sessions of their own; a SIGKILL of the job's group (the
    job, torchrun's agent) stops them too: none trains on into the key's folder that a rerun
    resumes from (draftflow.trainer_launch.stop_with_the_launcher)."""
    monkeypatch.setenv("STAND_IN_STEP_SECONDS", "0.2")
    job = subprocess.Popen([sys.executable, "-c", TRAINING_JOB, str(demo_run), str(tmp_path)], cwd=REPO, start_new_session=True)
    records = lambda: [json.loads(line) for line in metrics.read_text().splitlines()] if (metrics := next(  # noqa: E731
        (tmp_path / "work").glob("*/metrics.jsonl"), None)) else []  # fmt: skip
    deadline = time.monotonic() + 120
    while len(records()) < 2 and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(records()) >= 2, "the stand-in trainer never stepped"
    worker = records()[-1]["pid"]
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    if outlived := alive(worker):
        os.kill(worker, signal.SIGKILL)  # this test's own worker, left training
    assert not outlived, f"torchrun's worker {worker} outlived its job's process group"
    steps = len(records())
    time.sleep(1)  # five of its steps
    assert len(records()) == steps


def test_the_trainer_resumes_only_where_its_key_left_checkpoints_and_saves_every_n_steps(demo_run, tmp_path):
    view = demo_run / "training_data/train"
    settings = gpu_settings(checkpoint_every_steps=3)
    steps = trainer_steps_per_epoch(view, settings)
    resolved = TrainConfig.resolve(trainer_flags(demo_run / "drafter_untrained", view, settings, tmp_path))
    assert resolved.trainer.no_resume_from_checkpoint and resolved.trainer.checkpoint_freq == checkpoint_freq(3, steps)
    assert round(steps * checkpoint_freq(3, steps)) == 3 and checkpoint_freq(steps + 1, steps) == 1  # each epoch's end
    (tmp_path / "checkpoints/0").mkdir(parents=True)
    assert not TrainConfig.resolve(trainer_flags(demo_run / "drafter_untrained", view, settings, tmp_path)).trainer.no_resume_from_checkpoint


def test_the_key_follows_the_content_of_the_hidden_state_files_a_view_links(demo_run, tmp_path):
    """A file extracted again under its old name (another target's states, say) changes the
    view's identity through the sha256 its shard manifest records; the rows do too."""
    for stage in ("hidden_states", "training_data"):
        shutil.copytree(demo_run / stage, tmp_path / stage, symlinks=True)
    view = tmp_path / "training_data/train"
    before = view_identity(view)
    assert before == view_identity(demo_run / "training_data/train")  # the copy's links reach the copy's files, alike
    linked = next((view / "hidden_states").iterdir()).resolve()  # hidden_states/shard-<k>/hs_<id>.safetensors
    manifest = tmp_path / "hidden_states" / f"{linked.parent.name}.json"
    record = json.loads(manifest.read_text())
    (entry,) = [entry for entry in record["files"] if entry["file"] == f"{linked.parent.name}/{linked.name}"]
    entry["sha256"] = "0" * 64  # as the manifest of the file extracted again would say
    manifest.write_text(json.dumps(record))
    assert view_identity(view) != before
