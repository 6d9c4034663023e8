"""A thinking model's recipe (config/examples/qwen3-8b-thinking.yaml, issue 59) through the
workflow on the demo's target, whose answers think in <think>...</think> (tests/conftest.py
thinking_run): its answers sampled as the model is served, its reasoning parsed apart, its
gate read at the served temperature, its card serving with the reasoning parser."""

import json
import shlex

import pytest
import yaml

from tests.conftest import REPO

pytestmark = pytest.mark.slow

RECIPE = yaml.safe_load((REPO / "config/examples/qwen3-8b-thinking.yaml").read_text())


def test_the_thinking_recipe_passes_its_gate_at_the_temperature_it_is_served_at(thinking_run):
    served_at = RECIPE["generate"]["temperature"]
    sampling = json.loads((thinking_run / "synthetic/stats.json").read_text())["sampling"]["effective"]
    assert sampling == {"seed": 0, "temperature": served_at, **RECIPE["generate"]["sampling"]}
    evaluation = json.loads((thinking_run / "evaluation/evaluation.json").read_text())
    at_served = evaluation["temperatures"][f"{served_at:g}"]["mean_acceptance_length"]
    assert evaluation["gate"] == {"min_acceptance_length": RECIPE["evaluate"]["min_acceptance_length"], "temperature": served_at,
                                  "mean_acceptance_length": at_served, "passed": True}  # fmt: skip
    assert at_served != evaluation["trained"]["mean_acceptance_length"]  # not the greedy figure


def test_the_thinking_recipes_card_serves_with_the_reasoning_parser_as_serve_check_did(thinking_run):
    parser = ["--reasoning-parser", RECIPE["generate"]["reasoning_parser"]]
    card = (thinking_run / "drafter/README.md").read_text()
    command = shlex.split(next(line for line in card.splitlines() if line.startswith("vllm serve ")))
    assert any(command[i : i + 2] == parser for i in range(len(command)))
    # serve_check started vLLM with the card's flags, the parser among them, and it served the drafter
    log = (thinking_run.parents[1] / "logs/thinking/serve_check.server.log").read_text()
    started = shlex.split(log.split("starts a vLLM server at ", 1)[1].split(": ", 1)[1].splitlines()[0])
    assert any(started[i : i + 2] == parser for i in range(len(started)))
    served = json.loads((thinking_run / "evaluation/served.json").read_text())
    assert served["drafts"] > 0 and served["accepted_tokens"] > 0
    assert json.loads((thinking_run / "synthetic/stats.json").read_text())["reasoning_capture_rate"] > 0.5
