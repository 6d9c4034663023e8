"""A thinking model's recipe (config/examples/qwen3-8b-thinking.yaml, issue 59) through the
workflow on the demo's target, whose answers think in <think>...</think>: its answers sampled as
the model is served, its reasoning parsed apart, its gate read at the served temperature, its
card serving with the reasoning parser."""

import json
import shlex
import shutil

import pytest
import yaml

from tests.conftest import REPO, demo_config, snakemake

pytestmark = pytest.mark.slow

RECIPE = yaml.safe_load((REPO / "config/examples/qwen3-8b-thinking.yaml").read_text())


@pytest.fixture(scope="module")
def thinking_run(demo_run, tmp_path_factory):
    """The recipe's sampling, thinking, reasoning parser, evaluation temperatures, gate and early
    stopping on the demo's target at the demo's size (MT-Bench, the K sweep and its other
    temperatures left out), prompts to model card."""
    workdir = tmp_path_factory.mktemp("thinking")
    shutil.copytree(demo_run.parents[1] / "resources", workdir / "resources")
    generate = {key: value for key, value in RECIPE["generate"].items() if key not in ("max_tokens", "concurrency")}
    evaluate = {key: RECIPE["evaluate"][key] for key in ("temperatures", "min_acceptance_length")}
    config = demo_config(False, run="thinking", generate=generate, evaluate=evaluate,
                         train={"early_stopping_patience": RECIPE["train"]["early_stopping_patience"]})  # fmt: skip
    snakemake(workdir, config)
    return workdir / "results/thinking"


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
