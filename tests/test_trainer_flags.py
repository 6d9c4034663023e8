"""The flags draftflow gives speculators' Trainer on GPUs, resolved by the pinned speculators itself."""

import json

from datasets import Dataset
from speculators.train.config import TrainConfig
from speculators.train.config.resolution import resolve

from draftflow.train import TRAINER_DATA_RATIO, TrainSettings, trainer_flags, trainer_steps_per_epoch


def test_the_trainer_flags_resolve_in_speculators_to_the_train_settings(tmp_path):
    init_dir = tmp_path / "drafter_untrained"
    init_dir.mkdir()
    drafter_config = {"speculators_config": {"verifier": {"name_or_path": "/models/target"}},
                      "eagle_aux_hidden_state_layer_ids": [1, 2]}  # fmt: skip
    (init_dir / "config.json").write_text(json.dumps(drafter_config))
    settings = TrainSettings(
        epochs=3, lr=2e-4, weight_decay=0.01, warmup_steps=7, ttt_steps=3, ttt_step_loss_decay=0.9, seq_length=2048,
        loss_fn="kl_div", loss_implementation="eager", attention="sdpa", num_layers=1, checkpoint_every_steps=500,
        gpus=2, seed=5, device="cuda", selection_samples=0, early_stopping_patience=None,
    )  # fmt: skip
    view = tmp_path / "view"  # 40 rows of 100 tokens: speculators packs what the Trainer trains on (99%) into 2 sequences of 2,048
    Dataset.from_dict({"input_ids": [[1] * 100] * 40, "loss_mask": [[1] * 100] * 40, "seq_len": [100] * 40}).save_to_disk(str(view))
    (view / "hidden_states").mkdir()
    resolved = resolve(TrainConfig, trainer_flags(init_dir, view, settings, tmp_path / "work")).model_dump()
    assert resolved["trainer"]["epochs"] == 3 and resolved["seed"] == 5
    assert (resolved["optimizer"]["optimizer"], resolved["optimizer"]["lr"], resolved["optimizer"]["weight_decay"]) == ("adamw", 2e-4, 0.01)
    assert resolved["scheduler"]["scheduler_warmup_steps"] == 7
    assert resolved["data"]["total_seq_len"] == 2048 and resolved["data"]["data_path"] == str(view)
    # 2 GPUs: one packed sequence a rank an epoch, fewer steps than checkpoint_every_steps: each epoch's end
    assert trainer_steps_per_epoch(view, settings) == 1 and resolved["trainer"]["checkpoint_freq"] == 1
    assert resolved["trainer"]["no_resume_from_checkpoint"]  # no checkpoint of this key yet
    assert resolved["data"]["train_data_ratio"] == TRAINER_DATA_RATIO
    assert resolved["verifier"]["verifier_name_or_path"] == "/models/target"
