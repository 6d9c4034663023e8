"""What each stage writes: the one size model of the progress check and the plan.

Configs here are complete (``draftflow.config.load_config``: defaults filled
in). Standard library only, like the progress check.
"""

from __future__ import annotations

import os
from pathlib import Path

from draftflow import run_folder
from draftflow.extract.layout import hidden_state_bytes
from draftflow.target_model import TargetModel

LATER_OUTPUTS = {  # what each output after extraction writes under results/<run>/
    "untrained drafter": (run_folder.UNTRAINED_DRAFTER,),
    "drafter": (run_folder.TRAINED_DRAFTER,),
    "training checkpoints": (run_folder.TRAINING_WORK,),
    "training views": (run_folder.TRAINING_VIEWS,),
    "evaluation and report": (run_folder.EVALUATION, run_folder.REPORT),
}
REPORT_ALLOWANCE_BYTES = 200_000  # evaluation plots and JSON, the report and its charts (the demo: 93 kB)
VOCAB_PLOT_BYTES = 50_000  # coverage.png and coverage.json (the demo: 40 kB)


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path``; links count as links, not as their targets."""
    total = 0
    for directory, _, names in os.walk(path):
        total += sum(os.lstat(os.path.join(directory, name)).st_size for name in names)
    return total


def hidden_states_bytes(
    samples: int, tokens: int, num_layer_ids: int, hidden_size: int, dtype: str, storage: str
) -> int:
    """The extraction's bytes: exact data, each file's header at its upper bound."""
    file_bytes = lambda n: hidden_state_bytes(n, num_layer_ids, hidden_size, dtype, storage)  # noqa: E731
    return file_bytes(tokens) + (samples - 1) * file_bytes(0)


def fidelity_reference_bytes(
    samples: int, tokens: int, checked_samples: int, num_layer_ids: int, hidden_size: int, dtype: str
) -> int:
    """The fidelity reference's states: the first ``checked_samples`` samples (at the mean
    length) in the model's dtype, as one file."""
    checked = min(checked_samples, samples)
    return hidden_state_bytes(round(tokens * checked / max(samples, 1)), num_layer_ids, hidden_size, dtype, "full")


def vocab_map_bytes(target_vocab: int, draft_vocab: int) -> int:
    """d2t (int64 per draft token) and t2d (a bool per target token) as .npy files, and the coverage plot."""
    return draft_vocab * 8 + target_vocab + 2 * 128 + VOCAB_PLOT_BYTES


def drafter_parameters(target: TargetModel, num_aux: int, draft_vocab: int, num_layers: int) -> tuple[int, int]:
    """(saved, trained) parameters of speculators' EAGLE-3 drafter for this target.

    Saved: the embedding (target vocab x hidden) and lm_head (draft vocab x
    hidden), both taken from the target and frozen; fc with its input norm
    (aux layers x hidden -> hidden); decoder layers with the target's shapes,
    the first one reading [embedding, hidden] (2 x hidden) and holding the
    hidden norm; the final norm. Trained: all but the embedding and lm_head.
    """
    hidden, intermediate = target.hidden_size, target.setting("intermediate_size")
    heads, kv_heads, head_dim = target.setting("num_attention_heads"), target.kv_heads, target.head_dim

    def layer(inputs: int) -> int:
        attention = inputs * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
        return attention + 3 * hidden * intermediate + 2 * hidden

    first_layer = layer(2 * hidden) + hidden
    trained = num_aux * hidden * (hidden + 1) + first_layer + (num_layers - 1) * layer(hidden) + hidden
    return (target.vocab_size + draft_vocab) * hidden + trained, trained


def later_stage_bytes(
    config: dict, target: TargetModel, num_layer_ids: int, prepared_bytes: int, peak: bool = True
) -> dict[str, int]:
    """Bytes the stages after extraction write, at their peak or (``peak=False``) in the end, per output (see LATER_OUTPUTS).

    The untrained drafter is saved in bfloat16. The training state also holds
    the target's lm_head and norm, and Adam's two moments of the trained
    parameters. CPU (draftflow's loop): the drafter in float32, one training
    checkpoint, counted twice at the peak, as it is replaced by a new one
    atomically, and each epoch's drafter (the best is shipped). CUDA
    (speculators' Trainer): bfloat16 and a checkpoint per epoch, all kept.
    Training views: rows of the prepared dataset (``prepared_bytes``; the
    hidden states are links). Evaluation and report: a fixed allowance.
    """
    draft_vocab = config["vocab"]["draft_vocab_size"]
    saved, trained = drafter_parameters(target, num_layer_ids - 1, draft_vocab, config["train"]["num_layers"])
    in_training = saved + (draft_vocab + 1) * target.hidden_size
    if config["device"] == "cuda":
        drafter = 2 * in_training
        checkpoints = config["train"]["epochs"] * (2 * in_training + 4 * trained)
    else:
        drafter = 4 * saved
        checkpoints = (2 if peak else 1) * (4 * in_training + 8 * trained) + config["train"]["epochs"] * drafter
    return {
        "untrained drafter": 2 * saved,
        "drafter": drafter,
        "training checkpoints": checkpoints,
        "training views": prepared_bytes,
        "evaluation and report": REPORT_ALLOWANCE_BYTES,
    }
