"""Stage 6: train an EAGLE-3 drafter with speculators.

Both devices start from the same untrained checkpoint, built by speculators'
own ``train --dry-run``. On CUDA speculators' ``Trainer`` (torchrun) trains
it. The ``Trainer`` needs an accelerator, so on CPU a single-process loop
drives the same ``Eagle3DraftModel``, data classes and loss.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from speculators.losses.utils import resolve_loss_config
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.models.eagle3.data import shift_batch
from hs_connectors import FP8Transfer
from speculators.train.cli import main as speculators_train
from speculators.train.config import TrainConfig
from speculators.train.data import ArrowDataset, CollateFn
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
from torch.utils.data import DataLoader
from tqdm import tqdm
from transformers import get_cosine_schedule_with_warmup

from draftflow import trainer_launch
from draftflow.epoch_selection import (
    SCORE_FILE,
    EpochScorer,
    best_epoch,
    describe,
    measure_epochs,
    patience_spent,
    selection_stats,
)
from draftflow.io import atomic_path, write_json
from draftflow.fingerprint import file_sha256
from draftflow.target_model import read_target_model
from draftflow.training_data import view_identity


@dataclass(frozen=True)
class DrafterShape:
    """What the untrained drafter depends on (training settings do not change it)."""

    num_layers: int
    attention: str
    seed: int


@dataclass(frozen=True)
class TrainSettings:
    epochs: int
    lr: float
    weight_decay: float
    warmup_steps: int
    ttt_steps: int
    ttt_step_loss_decay: float
    seq_length: int
    loss_fn: str
    loss_implementation: str
    attention: str
    num_layers: int
    checkpoint_every_steps: int
    gpus: int
    seed: int
    device: str
    selection_samples: int
    early_stopping_patience: int | None


def drafter_flags(
    target: str, aux_layer_ids: list[int], d2t: Path, t2d: Path, shape: DrafterShape
) -> list[str]:
    """``speculators train`` flags that shape the drafter."""
    return [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", str(Path(target).resolve()),
        "--target-layer-ids", *map(str, aux_layer_ids),
        "--draft-vocab-size", str(len(np.load(d2t))),
        "--d2t-path", str(d2t),
        "--t2d-path", str(t2d),
        "--num-layers", str(shape.num_layers),
        "--draft-attn-impl", shape.attention,
        "--seed", str(shape.seed),
        # EAGLE-3 uses no mask token, but speculators resolves one for every drafter
        # type by loading the target's processor, which for multimodal targets needs
        # torchvision (not in the CPU set); any id in the vocabulary will do.
        "--mask-token-id", "0",
    ]  # fmt: skip


def init_drafter(target, aux_layer_ids, d2t, t2d, shape: DrafterShape, output: Path) -> None:
    """The untrained drafter, built by speculators (also the evaluation's floor): what
    ``speculators train --dry-run`` runs, in this process, which has speculators loaded."""
    with atomic_path(output) as tmp:
        flags = drafter_flags(target, aux_layer_ids, d2t, t2d, shape)
        speculators_train(TrainConfig.resolve([*flags, "--dry-run", "--save-path", str(tmp)]))


def load_drafter(path: Path, attention: str, dtype=torch.float32) -> Eagle3DraftModel:
    """A saved drafter with the verifier's embeddings, norm and lm_head loaded."""
    config = Eagle3SpeculatorConfig.from_pretrained(str(path))
    # Saved configs name no attention, and the model then picks flex
    # attention, which has no CPU backward.
    config.transformer_layer_config._attn_implementation = attention  # noqa: SLF001
    model = Eagle3DraftModel.from_pretrained(str(path), config=config)
    model.load_verifier_weights()
    match_target_final_norm(model)
    return model.to(dtype)


def match_target_final_norm(model: Eagle3DraftModel) -> None:
    """speculators' ``verifier_norm`` scales by its weight alone and loads the target's
    norm weight into it; a target whose norm scales by 1 + weight (Gemma-3, whose
    weight starts at 0) would then give training targets of all-zero logits. Call it
    after the last load_verifier_weights(), which reloads the weight."""
    target = read_target_model(model.config.speculators_config.verifier.name_or_path)
    with torch.no_grad():
        model.verifier_norm.weight += target.final_norm_offset


def view_dataset(view_dir: Path, settings: TrainSettings, train_ratio: float = 1.0) -> ArrowDataset:
    """speculators' dataset of a view's rows (its first ``train_ratio``, as the Trainer splits them)."""
    return ArrowDataset(
        max_len=settings.seq_length,
        datapath=str(view_dir),
        # reads both extract.storage formats: files without fp8 scales pass through
        transfer=FP8Transfer(view_dir / "hidden_states", dequantize_dtype=torch.float32),
        on_missing="raise",
        train_ratio=train_ratio,
        hidden_states_dtype=torch.float32,
    )


def packed_batches(dataset: ArrowDataset, settings: TrainSettings, replicas: int = 1) -> MultipackDistributedBatchSamplerV2:
    """The batches of rows packed to ``settings.seq_length`` tokens, of the first of ``replicas`` ranks."""
    return MultipackDistributedBatchSamplerV2(batch_max_length=settings.seq_length, lengths=dataset.approx_lengths,
                                              num_replicas=replicas, rank=0, seed=settings.seed)  # fmt: skip


def data_loader(view_dir: Path, settings: TrainSettings, num_aux: int, hidden_size: int, epoch: int) -> DataLoader:
    dataset = view_dataset(view_dir, settings)
    sampler = packed_batches(dataset, settings)
    sampler.set_epoch(epoch)
    collate = CollateFn(
        settings.seq_length, hidden_size, num_target_layers=num_aux, dtype=torch.float32, preprocess=shift_batch
    )
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=0)


MODEL_INPUTS = ("hidden_states", "input_ids", "document_ids", "loss_mask", "position_ids", "verifier_last_hidden_states")


class Checkpoint:
    """Training state saved atomically every N steps in the training key's folder
    (``keyed_work_dir``); a rerun of that key continues from it."""

    def __init__(self, path: Path):
        self.path = path

    def load(self) -> dict | None:
        return torch.load(self.path, weights_only=False) if self.path.exists() else None

    def save(self, model, optimizer, scheduler, epoch: int, step_in_epoch: int, global_step: int, history: list) -> None:
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "epoch": epoch,
            "step_in_epoch": step_in_epoch,
            "global_step": global_step,
            "history": history,  # the losses so far: a resumed run reports every step's
        }
        with atomic_path(self.path) as tmp:
            torch.save(state, tmp)


def cpu_epoch_folder(work_dir: Path, epoch: int) -> Path:
    """Where the CPU loop keeps ``epoch``'s drafter, as the epoch ends."""
    return work_dir / "epochs" / str(epoch)


def finished_epoch_folders(folder_of, epochs: int) -> list[Path]:
    """The drafter folders of the epochs finished so far, epoch 0 first (``folder_of(epoch)``:
    the folder, or None where that epoch has not ended)."""
    folders = []
    for epoch in range(epochs):
        if (folder := folder_of(epoch)) is None:
            break
        folders.append(folder)
    return folders


def train_on_cpu(
    init_dir: Path, view_dir: Path, settings: TrainSettings, work_dir: Path, output: Path, scorer: EpochScorer | None
) -> dict:
    torch.manual_seed(settings.seed)
    model = load_drafter(init_dir, settings.attention)
    num_aux = len(model.config.eagle_aux_hidden_state_layer_ids)
    steps_per_epoch = len(data_loader(view_dir, settings, num_aux, model.hidden_size, 0))
    total_steps = steps_per_epoch * settings.epochs
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings.lr, weight_decay=settings.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, settings.warmup_steps, total_steps)
    loss_config = resolve_loss_config(settings.loss_fn, "eager")
    checkpoint = Checkpoint(work_dir / "checkpoint.pt")
    start_epoch, skip_steps, global_step, history = 0, 0, 0, []
    if state := checkpoint.load():
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, skip_steps, global_step = state["epoch"], state["step_in_epoch"], state["global_step"]
        history = state["history"]
        print(f"resuming at epoch {start_epoch}, step {skip_steps} (global step {global_step})")

    def folder_of(epoch: int) -> Path | None:
        return folder if (folder := cpu_epoch_folder(work_dir, epoch)).exists() else None

    curve = measure_epochs(finished_epoch_folders(folder_of, start_epoch), scorer, settings.early_stopping_patience)
    started = time.monotonic()
    tokens = 0
    model.train()
    progress = tqdm(total=total_steps, initial=global_step, desc="train", unit="step")
    for epoch in range(start_epoch, settings.epochs):
        if patience_spent(curve, settings.early_stopping_patience):
            print(f"stopping before epoch {epoch + 1}: {settings.early_stopping_patience} epoch(s) without a better drafter")
            break
        for step, batch in enumerate(data_loader(view_dir, settings, num_aux, model.hidden_size, epoch), 1):
            if epoch == start_epoch and step <= skip_steps:
                continue
            _, loss, metrics = model(
                **{k: batch[k] for k in MODEL_INPUTS},
                ttt_steps=settings.ttt_steps,
                ttt_step_loss_decay=settings.ttt_step_loss_decay,
                loss_config=loss_config,
            )
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            scheduler.step()
            global_step += 1
            tokens += int(batch["loss_mask"].sum())
            history.append({"step": global_step, "epoch": epoch, "loss": loss.item()})
            progress.update(1)
            progress.set_postfix(loss=f"{loss.item():.3f}", epoch=epoch)
            if global_step % settings.checkpoint_every_steps == 0:
                checkpoint.save(model, optimizer, scheduler, epoch, step, global_step, history)
        skip_steps = 0
        save_drafter(model, cpu_epoch_folder(work_dir, epoch))
        checkpoint.save(model, optimizer, scheduler, epoch + 1, 0, global_step, history)  # a rerun starts the next epoch
        if scorer is not None:
            curve = measure_epochs(finished_epoch_folders(folder_of, epoch + 1), scorer, settings.early_stopping_patience)
            progress.write(f"epoch {epoch + 1}: mean acceptance length {curve[-1]['mean_acceptance_length']:.3f} (decoding replay)")
    progress.close()
    seconds = time.monotonic() - started
    finished = finished_epoch_folders(folder_of, settings.epochs)
    ship_epoch(finished, curve, output)
    return {
        "steps": global_step,
        "epochs": settings.epochs,
        "final_loss": history[-1]["loss"] if history else None,
        "loss_history": history,
        "seconds_this_run": seconds,
        "supervised_tokens_per_second": tokens / seconds if seconds else 0.0,
        "gpus": 0,
        "trainer": "draftflow single-process loop (CPU)",
        "curve": curve,
    }


STEP_NEUTRAL_SETTINGS = ("checkpoint_every_steps", "selection_samples", "early_stopping_patience")


def training_key(init_dir: Path, view_dir: Path, settings: TrainSettings) -> str:
    """What a training run's checkpoints belong to: its settings, the untrained drafter it starts
    from (its config and weights: speculators' run records beside them name times and folders)
    and what it reads of its view (``view_identity``)."""
    # how often it saves, which epochs are measured and where training stops change no step; the
    # GPU count does (each rank's share of an epoch)
    trained_by = {name: value for name, value in asdict(settings).items() if name not in STEP_NEUTRAL_SETTINGS}
    digest = hashlib.sha256()
    drafter = [file_sha256(init_dir / name) for name in ("config.json", "model.safetensors")]
    for part in (json.dumps(trained_by, sort_keys=True), *drafter, view_identity(view_dir)):
        digest.update(part.encode() + b"\n")
    return digest.hexdigest()[:16]


def keyed_work_dir(work_dir: Path, key: str) -> Path:
    """``work_dir/<key>``, where the training run of ``key`` keeps its checkpoints; what other
    keys left there (a run before an edit of the settings or the data) is removed: resumed
    from, it would ship the old drafter under the new key."""
    work_dir.mkdir(parents=True, exist_ok=True)
    for other in work_dir.iterdir():
        if other.name != key:
            print(f"removing {other}: another training run's checkpoints (other settings or data), never resumed from")
            shutil.rmtree(other) if other.is_dir() and not other.is_symlink() else other.unlink()
    return work_dir / key


def train_drafter(
    init_dir: Path, view_dir: Path, settings: TrainSettings, work_dir: Path, output: Path, scorer: EpochScorer | None = None
) -> dict:
    """Train on the device ``settings`` name, resuming only this training key's checkpoints;
    ``scorer`` measures each epoch's drafter as it ends (``draftflow.epoch_selection``) and the
    best is shipped to ``output``, else the last."""
    key = training_key(init_dir, view_dir, settings)
    train = train_on_cpu if settings.device == "cpu" else train_with_trainer
    print(f"training key {key}: checkpoints in {work_dir / key}")
    stats = train(init_dir, view_dir, settings, keyed_work_dir(work_dir, key), output, scorer)
    stats["selection"] = selection_stats(scorer, stats.pop("curve"), settings.epochs, settings.early_stopping_patience,
                                         stats.get("loss_history", []))  # fmt: skip
    print(f"shipped: {describe(stats['selection'])}")
    return stats


def ship_epoch(finished: list[Path], curve: list[dict], output: Path) -> None:
    """The best epoch's drafter (``curve``'s; the last finished where nothing was measured) to ``output``."""
    best = best_epoch(curve)
    chosen = finished[-1] if best is None else finished[best - 1]
    with atomic_path(output) as tmp:
        shutil.copytree(chosen, tmp, ignore=shutil.ignore_patterns(SCORE_FILE, "training_state.json", "optimizer*", "scheduler*"))


def save_drafter(model: Eagle3DraftModel, output: Path) -> None:
    with atomic_path(output) as tmp:
        model.save_pretrained(str(tmp))


# speculators' Trainer validates on the last rows of its data and takes no ratio of 1
# (train_data_ratio must lie in (0, 1)): the smallest share it allows, on rows that
# train_views already split from evaluation's.
TRAINER_DATA_RATIO = 0.99


def trainer_steps_per_epoch(view_dir: Path, settings: TrainSettings) -> int:
    """The steps each of the Trainer's ``settings.gpus`` ranks takes per epoch on the view: its
    packing of the rows it trains on (the first TRAINER_DATA_RATIO), as its data loader packs them."""
    return len(packed_batches(view_dataset(view_dir, settings, TRAINER_DATA_RATIO), settings, settings.gpus))


def checkpoint_freq(every_steps: int, steps_per_epoch: int) -> float:
    """speculators' ``--checkpoint-freq`` for a checkpoint every ``every_steps`` steps: the
    fraction of an epoch they are (it saves every round(steps x fraction) steps), or 1, each
    epoch's end, where an epoch is shorter."""
    return every_steps / steps_per_epoch if every_steps < steps_per_epoch else 1


def resumable(checkpoints: Path) -> bool:
    """Whether speculators' Trainer left a checkpoint (a numbered folder) in ``checkpoints``."""
    return any(path.name.isdigit() for path in checkpoints.glob("*"))


def trainer_flags(init_dir: Path, view_dir: Path, settings: TrainSettings, work_dir: Path) -> list[str]:
    """speculators' ``train`` flags for ``settings``: the Trainer's recipe, also timed by
    bench/gpu/train_bench.py. Checkpoints go to ``work_dir/checkpoints`` every
    ``settings.checkpoint_every_steps`` steps (or each epoch's end, where an epoch is shorter);
    the Trainer resumes from them where they exist (``work_dir`` is the training key's,
    ``keyed_work_dir``) and starts over where none does."""
    checkpoints = work_dir / "checkpoints"
    every = checkpoint_freq(settings.checkpoint_every_steps, trainer_steps_per_epoch(view_dir, settings))
    return [
        "--speculator-type", "eagle3",
        "--from-pretrained", str(init_dir),
        "--verifier-name-or-path", drafter_identity(init_dir)[0],
        "--draft-attn-impl", settings.attention,
        # the CPU loop's recipe, so train.lr and warmup mean the same on both devices
        # (speculators' defaults are Muon, at its own learning rate, and a linear schedule)
        "--optimizer", "adamw",
        "--scheduler-type", "cosine",
        "--ttt-steps", str(settings.ttt_steps),
        "--ttt-step-loss-decay", str(settings.ttt_step_loss_decay),
        "--loss-fn", settings.loss_fn,
        "--loss-implementation", settings.loss_implementation,
        "--seed", str(settings.seed),
        "--save-path", str(checkpoints),
        "--checkpoint-freq", str(every),
        *([] if resumable(checkpoints) else ["--no-resume-from-checkpoint"]),
        "--data-path", str(view_dir),
        "--epochs", str(settings.epochs),
        "--lr", str(settings.lr),
        "--weight-decay", str(settings.weight_decay),
        "--scheduler-warmup-steps", str(settings.warmup_steps),
        "--total-seq-len", str(settings.seq_length),
        "--on-missing", "raise",
        "--hidden-states-backend", "fp8",  # reads both extract.storage formats (see data_loader)
        "--train-data-ratio", str(TRAINER_DATA_RATIO),
        "--log-dir", str(work_dir / "logs"),
    ]  # fmt: skip


TRAINER_LAUNCH = trainer_launch.__name__  # what torchrun runs: speculators' Trainer, as draftflow keeps its records


def trainer_epoch_folder(checkpoints: Path, epoch: int) -> Path | None:
    """speculators' Trainer's checkpoint of ``epoch`` where it holds the epoch's end (its
    ``training_state.json`` says local step 0; a checkpoint inside the epoch says more), else None."""
    state = checkpoints / str(epoch) / "training_state.json"
    if not state.exists():
        return None
    recorded = json.loads(state.read_text())
    return state.parent if recorded.get("epoch") == epoch and recorded.get("local_step", 0) == 0 else None


# How often the training job looks for an epoch the Trainer finished, to measure it (seconds).
EPOCH_POLL_S = 2.0


def train_with_trainer(
    init_dir: Path, view_dir: Path, settings: TrainSettings, work_dir: Path, output: Path, scorer: EpochScorer | None
) -> dict:
    """speculators' Trainer under torchrun, one process per GPU.

    ``draftflow.trainer_launch`` runs speculators' own entry point and keeps the
    Trainer's per-step metric records and each rank's peak GPU memory in
    ``work_dir/metrics.jsonl``, so the stats say what the CPU loop's say: steps,
    losses and supervised tokens/s. Each epoch's checkpoint is measured as the
    Trainer writes it (``scorer``); once ``settings.early_stopping_patience`` epochs
    pass without a better one the Trainer is stopped, and a rerun does not start it.
    """
    metrics = work_dir / "metrics.jsonl"
    checkpoints = work_dir / "checkpoints"
    work_dir.mkdir(parents=True, exist_ok=True)
    if not resumable(checkpoints):
        metrics.unlink(missing_ok=True)  # a resumed run's steps add to those before the kill

    def measured() -> tuple[list[Path], list[dict]]:
        finished = finished_epoch_folders(lambda epoch: trainer_epoch_folder(checkpoints, epoch), settings.epochs)
        return finished, measure_epochs(finished, scorer, settings.early_stopping_patience)

    started = time.monotonic()
    finished, curve = measured()
    if len(finished) < settings.epochs and not patience_spent(curve, settings.early_stopping_patience):
        command = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={settings.gpus}",
            "-m", TRAINER_LAUNCH, str(metrics), *trainer_flags(init_dir, view_dir, settings, work_dir),
        ]  # fmt: skip
        trainer = subprocess.Popen(command)
        try:
            while trainer.poll() is None:
                time.sleep(EPOCH_POLL_S)
                finished, curve = measured()
                if patience_spent(curve, settings.early_stopping_patience):
                    print(f"stopping the Trainer after epoch {len(curve)}: {settings.early_stopping_patience} epoch(s) without a better drafter")
                    break
            else:
                if trainer.returncode:
                    raise subprocess.CalledProcessError(trainer.returncode, command)
        finally:
            stop(trainer)  # stopped early, or measuring an epoch failed: none trains on behind the job's back
        finished, curve = measured()
    seconds = time.monotonic() - started
    ship_epoch(finished, curve, output)
    stats = {
        "epochs": settings.epochs,
        "seconds_this_run": seconds,
        "gpus": settings.gpus,
        "trainer": f"speculators Trainer ({settings.gpus} process{'es' if settings.gpus > 1 else ''}, bf16 autocast)",
        "curve": curve,
    }
    return stats | trainer_metrics(metrics, view_dir, settings, TRAINER_DATA_RATIO)


def stop(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM (torchrun passes it to its workers, which also die with it), then SIGKILL after
    ``grace_s``; nothing where it has ended."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def trainer_metrics(metrics: Path, view_dir: Path, settings: TrainSettings, data_ratio: float) -> dict:
    """Steps, losses, supervised tokens/s and peak GPU memory from ``trainer_launch``'s records."""
    from datasets import load_from_disk

    entries = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    steps = [e for e in entries if "step" in e]
    peaks = [e["peak_memory_gib"] for e in entries if "peak_memory_gib" in e]
    stats = {"peak_gpu_memory_gib": max(peaks)} if peaks else {}
    if not steps:
        return stats
    profiles = [s["profile"] or {} for s in steps]
    masks = load_from_disk(str(view_dir)).with_format(None)["loss_mask"]
    supervised = sum(sum(mask) for mask in masks[: int(len(masks) * data_ratio)]) * settings.epochs
    training_seconds = steps[-1]["time"] - steps[0]["time"] + profiles[0].get("step_ms", 0.0) / 1000
    after_first = steps[-1]["time"] - steps[0]["time"]
    tokens_after_first = settings.gpus * sum(p.get("tokens_per_s", 0.0) * p.get("step_ms", 0.0) / 1000 for p in profiles[1:])
    return stats | {
        "steps": steps[-1]["step"] + 1,
        "final_loss": steps[-1]["loss"],
        "loss_history": [{"step": s["step"] + 1, "epoch": s["epoch"], "loss": s["loss"]} for s in steps],
        "training_seconds": training_seconds,
        "supervised_tokens_per_second": supervised / training_seconds if training_seconds else 0.0,
        "tokens_per_second_after_first_step": tokens_after_first / after_first if after_first else 0.0,
    }


def drafter_identity(drafter_dir: Path) -> tuple[str, list[int]]:
    """(verifier path, aux layer ids) recorded in a drafter's config."""
    config = json.loads((drafter_dir / "config.json").read_text())
    verifier = config["speculators_config"]["verifier"]["name_or_path"]
    return verifier, config["eagle_aux_hidden_state_layer_ids"]


def finalize_config(
    drafter_dir: Path, target: str, aux_layer_ids: list[int], speculative_tokens: int | None = None
) -> None:
    """Make the config self-describing: absolute verifier path, explicit layer ids,
    and the number of tokens to propose (the steps it was trained to draft)."""
    path = drafter_dir / "config.json"
    config = json.loads(path.read_text())
    config["eagle_aux_hidden_state_layer_ids"] = list(aux_layer_ids)
    speculators = config["speculators_config"]
    speculators["verifier"]["name_or_path"] = str(Path(target).resolve())
    if speculative_tokens:
        for proposal in speculators["proposal_methods"]:
            proposal["speculative_tokens"] = speculative_tokens
    write_json(path, config)
