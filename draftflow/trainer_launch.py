"""speculators' training entry point, keeping what draftflow reports about the run.

Run by ``draftflow.train.train_with_trainer`` under torchrun as
``-m draftflow.trainer_launch METRICS_JSONL <speculators train flags>``. Rank 0
appends the Trainer's per-step metric records to METRICS_JSONL; every rank
appends its peak GPU memory at the end. The drafter it builds gets the target's
final-norm offset, as ``draftflow.train.load_drafter``'s does. Each worker dies
with its torchrun agent (``stop_with_the_launcher``).
"""

import ctypes
import json
import logging
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1  # linux/prctl.h: the signal a process gets when its parent dies


class StepRecords(logging.Handler):
    """Keeps the Trainer's per-step metric records (dicts logged to ``speculators.metrics``)."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        metrics = record.msg
        if isinstance(metrics, dict) and "train" in metrics and "global_step" in metrics:
            step = {
                "time": time.time(),
                "step": metrics["global_step"],
                "epoch": metrics.get("epoch"),
                "loss": metrics["train"].get("loss"),
                "profile": metrics.get("profile"),
            }
            append_json_line(self.path, step)


def append_json_line(path: str, entry: dict) -> None:
    with open(path, "a") as stream:
        stream.write(json.dumps(entry) + "\n")


def keep_step_records(cli, metrics_path: str, rank: int) -> None:
    setup_metric_logger = cli.setup_metric_logger

    def setup_and_keep_steps(*args, **kwargs):
        setup_metric_logger(*args, **kwargs)
        if rank == 0:
            logging.getLogger("speculators.metrics").addHandler(StepRecords(metrics_path))

    cli.setup_metric_logger = setup_and_keep_steps


def match_target_final_norm_on_build(cli) -> None:
    """The drafter the Trainer trains, with its verifier_norm scaling as the target's
    final norm does (see ``draftflow.train.match_target_final_norm``)."""
    from draftflow.train import match_target_final_norm

    build_draft_model = cli.build_draft_model

    def build_and_match(*args, **kwargs):
        model = build_draft_model(*args, **kwargs)
        match_target_final_norm(model)
        return model

    cli.build_draft_model = build_and_match


def stop_with_the_launcher() -> None:
    """Have Linux SIGKILL this worker when its torchrun agent dies. torchrun starts each worker
    in a session of its own, so a kill of the training job's process group (a scheduler's
    SIGKILL, ``kill -9 -- -PGID``) takes the agent and Snakemake but leaves the workers
    training on, writing checkpoints into the key's folder that a rerun resumes from (seen on
    an H100, 2026-12-07: the rerun found the killed run's later epochs). Not on other systems."""
    if not sys.platform.startswith("linux"):
        return
    agent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != agent:  # the agent died before the request took hold
        os._exit(1)


def main() -> None:
    stop_with_the_launcher()
    import speculators.train.cli as cli
    import torch
    from speculators.train.config import TrainConfig

    metrics_path, rank = sys.argv[1], int(os.environ.get("RANK", "0"))
    keep_step_records(cli, metrics_path, rank)
    match_target_final_norm_on_build(cli)
    cli.main(TrainConfig.resolve(sys.argv[2:]))
    if torch.cuda.is_available():
        append_json_line(metrics_path, {"rank": rank, "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30})


if __name__ == "__main__":  # the data loader's spawned workers import this module
    main()
