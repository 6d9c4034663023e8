"""serve_check's decisions on hand-made logs, drafters and numbers (issue 26); the workflow's
own failures are tried on a twin (tests/test_twin_workflows.py)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from draftflow.serve_check import ServeCheckFailed, decide, file_problems, layer_problem, served_aux_layers, shortfall_problem
from draftflow.vllm_server import START_MARKER

LOGGED = "(EngineCore pid=7) INFO 12-01 18:37:48 [gpu_model_runner.py:5243] Using auxiliary layers from speculative config: (1, 2, 3)\n"


def test_the_aux_layers_come_from_the_last_starts_log_line_else_from_vllms_default():
    earlier = f"{START_MARKER} at 2026-12-01 10:00:00: python -m vllm...\n{LOGGED}"
    latest = f"{START_MARKER} at 2026-12-01 11:00:00: python -m vllm...\nINFO ... Starting vLLM server\n"
    assert served_aux_layers(earlier, 9) == ([1, 2, 3], "the drafter's config")
    layers, source = served_aux_layers(earlier + latest, 9)
    assert layers == [2, 4, 6] and source.startswith("vLLM's default")  # vLLM's (2, N // 2, N - 3)


def drafter(folder, config: dict, weights: list[str]):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({name: torch.zeros(2) for name in weights}, str(folder / "model.safetensors"))
    return folder


TRAINED = {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "draft_vocab_size": 64, "norm_before_residual": True}


def test_a_drafter_served_as_trained_has_no_problems(tmp_path):
    served = drafter(tmp_path / "served", {**TRAINED, "norm_before_fc": True}, ["d2t", "fc.weight", "input_norm.weight"])
    trained = drafter(tmp_path / "trained", TRAINED, ["d2t"])
    assert file_problems(served, trained, 256) == []
    assert layer_problem({"served": [1, 2, 3], "from": "the drafter's config"}, trained, served) is None


def test_each_way_vllm_would_serve_the_drafter_otherwise_is_named(tmp_path):
    served = drafter(tmp_path / "served", {"draft_vocab_size": 64}, ["fc.weight", "input_norm.weight", "fc_norm.0.weight"])
    trained = drafter(tmp_path / "trained", TRAINED, ["d2t"])
    layers = layer_problem({"served": [2, 4, 6], "from": "vLLM's default"}, trained, served)
    assert "vLLM served aux layers [2, 4, 6] (vLLM's default)" in layers and "trained on [1, 2, 3]" in layers
    problems = file_problems(served, trained, 256)
    assert len(problems) == 4, problems
    d2t, norm_before_fc, fc_norm, norm_before_residual = problems
    assert "lack d2t" in d2t and "64 draft tokens into the target's 256" in d2t
    assert "norm_before_fc=False" in norm_before_fc and "trained with True" in norm_before_fc
    assert "fc_norm=False" in fc_norm
    assert "norm_before_residual=False" in norm_before_residual


def test_a_drafter_over_the_whole_vocabulary_needs_no_d2t(tmp_path):
    config = {**TRAINED, "draft_vocab_size": 256}
    served = drafter(tmp_path / "served", config, ["fc.weight"])
    assert file_problems(served, drafter(tmp_path / "trained", config, []), 256) == []


OFFLINE = {"mean_acceptance_length": 2.89, "acceptance_per_position": [0.7, 0.6, 0.59]}


def test_the_demos_served_acceptance_passes_and_a_served_drafter_on_default_layers_fails():
    demo = {"mean_acceptance_length": 2.76, "acceptance_per_position": [0.68, 0.56, 0.52]}
    assert shortfall_problem(OFFLINE, demo, 0.25) is None
    # a public report: 1.04 served on the target's default layers, 2.77 offline
    wrong_layers = {"mean_acceptance_length": 1.04, "acceptance_per_position": [0.04, 0.0, 0.0]}
    problem = shortfall_problem(OFFLINE, wrong_layers, 0.25)
    assert "1.040 tokens per step against 2.890 offline, 64% short" in problem
    assert "1: 0.700 offline, 0.040 served" in problem and "3: 0.590 offline, 0.000 served" in problem


def test_the_decision_names_every_problem_with_the_measured_numbers():
    decide({"drafts": 10}, [])
    with pytest.raises(ServeCheckFailed, match=r"(?s)- first.*- second.*Measured: \{\"drafts\": 10\}"):
        decide({"drafts": 10}, ["first", "second"])
