"""A stand-in for speculators' Trainer with its save-path contract, for CPU tests of
``draftflow.train.train_with_trainer`` (the Trainer moves its model to an accelerator and fails
without one). Run as ``draftflow.trainer_launch`` is, under torchrun:
``-m tests.trainer_stand_in METRICS_JSONL <speculators train flags>``.

What it keeps of the Trainer (speculators/train/trainer.py): the flags are resolved by
speculators' own ``TrainConfig``; an epoch is as many steps as the Trainer's data loader packs
the view's training rows into (speculators' dataset and batch sampler); checkpoints go to ``<save-path>/<epoch>/`` (the drafter's
``config.json`` and ``model.safetensors``, and ``training_state.json`` with the epoch, the step
within it, 0 at its end, and the global step), every ``round(steps x checkpoint_freq)`` steps
where that is below 1, else at each epoch's end; it resumes from the newest one unless
``--no-resume-from-checkpoint``, else starts from ``--from-pretrained``. Each step adds
``lr x (its global step)`` to every floating-point weight, so the weights say which learning rate trained them,
for how many steps, and from where. ``STAND_IN_DIE_AFTER_STEPS=N`` kills it after its N-th step
of this run, as a lost node would; ``STAND_IN_STEP_SECONDS`` makes each step take that long.
As ``draftflow.trainer_launch`` does first, it asks to die with its torchrun agent."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from hs_connectors import FP8Transfer
from safetensors.torch import load_file, save_file
from speculators.train.config import TrainConfig
from speculators.train.data import ArrowDataset
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

from draftflow.trainer_launch import stop_with_the_launcher



def steps_per_epoch(config: dict) -> int:
    """Batches of the view's first train_data_ratio of rows, packed as the Trainer's loader packs them."""
    data = config["data"]
    dataset = ArrowDataset(max_len=data["total_seq_len"], datapath=data["data_path"], train_ratio=data["train_data_ratio"],
                           transfer=FP8Transfer(Path(data["data_path"]) / "hidden_states"), on_missing="raise")  # fmt: skip
    return len(MultipackDistributedBatchSamplerV2(batch_max_length=data["total_seq_len"], lengths=dataset.approx_lengths,
                                                  num_replicas=1, rank=0, seed=config["seed"]))  # fmt: skip


def newest_checkpoint(save_path: Path) -> Path | None:
    numbered = [path for path in save_path.glob("*") if path.name.isdigit()]
    return max(numbered, key=lambda path: int(path.name)) if numbered else None


def save(folder: Path, weights: dict, init: Path, state: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(init / "config.json", folder / "config.json")
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "training_state.json").write_text(json.dumps(state))


def main() -> None:
    stop_with_the_launcher()
    metrics, config = Path(sys.argv[1]), TrainConfig.resolve(sys.argv[2:]).model_dump()
    trainer, init = config["trainer"], Path(config["draft"]["from_pretrained"])
    save_path, lr, every = Path(trainer["save_path"]), config["optimizer"]["lr"], trainer["checkpoint_freq"]
    epoch_steps = steps_per_epoch(config)
    interval = max(1, round(epoch_steps * every)) if every < 1 else epoch_steps
    resumed = None if trainer["no_resume_from_checkpoint"] else newest_checkpoint(save_path)
    weights = load_file(str((resumed or init) / "model.safetensors"))
    state = json.loads((resumed / "training_state.json").read_text()) if resumed else {"epoch": 0, "local_step": 0, "global_step": 0}
    epoch, step = (state["epoch"] + 1, 0) if resumed and state["local_step"] == 0 else (state["epoch"], state["local_step"])
    global_step, die_after = state["global_step"], int(os.environ.get("STAND_IN_DIE_AFTER_STEPS", 0))
    print(f"stand-in trainer: {'resumed from ' + str(resumed) if resumed else 'started from ' + str(init)}, epoch {epoch} step {step}")
    run_steps = 0
    while epoch < trainer["epochs"]:
        step, global_step, run_steps = step + 1, global_step + 1, run_steps + 1
        # the weights move; the vocabulary maps (d2t, t2d: integer and boolean buffers) stay, as the Trainer's do
        weights = {name: tensor + lr * global_step if tensor.is_floating_point() else tensor for name, tensor in weights.items()}
        time.sleep(float(os.environ.get("STAND_IN_STEP_SECONDS", 0)))
        with metrics.open("a") as stream:
            stream.write(json.dumps({"time": global_step, "step": global_step - 1, "epoch": epoch, "loss": 1 / global_step,
                                     "profile": None, "pid": os.getpid()}) + "\n")  # fmt: skip
        if step == epoch_steps or step % interval == 0:
            done = step == epoch_steps
            save(save_path / str(epoch), weights, init, {"epoch": epoch, "local_step": 0 if done else step, "global_step": global_step})
            epoch, step = (epoch + 1, 0) if done else (epoch, step)
        if run_steps == die_after:
            os._exit(1)

if __name__ == "__main__":
    main()
