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


# The evaluation's decoding replay for the prompts served (issue 43: what vLLM's counters
# should say), and vLLM's own numbers.
PREDICTED = {"mean_acceptance_length": 2.40, "acceptance_per_position": [0.6, 0.45, 0.35]}


def test_served_acceptance_is_held_to_the_replay_on_drafts_accepted_per_step():
    near_ties = {"mean_acceptance_length": 2.33, "acceptance_per_position": [0.58, 0.43, 0.32]}  # 5% fewer per step
    assert shortfall_problem(PREDICTED, near_ties, 0.1) is None
    # a public report: 1.04 served on the target's default layers
    wrong_layers = {"mean_acceptance_length": 1.04, "acceptance_per_position": [0.04, 0.0, 0.0]}
    problem = shortfall_problem(PREDICTED, wrong_layers, 0.25)
    assert "accepted 0.040 drafts per step (mean acceptance length 1.040) against 1.400 predicted" in problem
    assert "97% short" in problem
    assert "1: 0.600 predicted, 0.040 served" in problem and "3: 0.350 predicted, 0.000 served" in problem
    # on drafts per step, not on the mean acceptance length: 10% short of 2.40 is 26% short of 1.40
    assert "26% short" in shortfall_problem(PREDICTED, {**near_ties, "mean_acceptance_length": 2.04}, 0.25)


def test_the_decision_names_every_problem_with_the_measured_numbers():
    decide({"drafts": 10}, [])
    with pytest.raises(ServeCheckFailed, match=r"(?s)- first.*- second.*Measured: \{\"drafts\": 10\}"):
        decide({"drafts": 10}, ["first", "second"])


def test_at_a_temperature_the_bound_widens_by_the_noise_of_two_draws():
    predicted = {**PREDICTED, "drafts": 400, "accepted_drafts_std": 1.2}
    # 36% short of 1.40 drafts per step: a failure at temperature 0
    served = {"mean_acceptance_length": 1.9, "acceptance_per_position": [0.45, 0.25, 0.2], "drafts": 100}
    assert "at temperature 0 vLLM accepted 0.900" in shortfall_problem(predicted, served, 0.25)
    # at 0.7 three standard errors of the two draws: 3 * 1.2 * sqrt(1/400 + 1/100) = 0.402
    assert shortfall_problem(predicted, served, 0.25, temperature=0.7) is None
    # the more drafts served and replayed, the narrower: 40,000 and 10,000 give 0.040
    many = shortfall_problem({**predicted, "drafts": 40000}, {**served, "drafts": 10000}, 0.25, temperature=0.7)
    assert "at temperature 0.7 vLLM accepted 0.900" in many and "three standard errors of two draws (0.040" in many
