"""Evaluation before issue 57's chunked weighing (``draftflow/evaluate.py`` at 8325886^, read
from git) against the current one, on finished runs: the gate's figures at K = draft_tokens on
the held-out slice, at temperature 0 and at 1 (generation's top_k/top_p), the same drafter,
views and target head for both. Prints one line per run and temperature.

    .venv/bin/python bench/evaluate_unchanged.py RUN_DIR...   (results/<run> folders)
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch._dynamo

from draftflow import evaluate as current
from draftflow.io import read_json
from draftflow.prompt_sources import HELDOUT
from draftflow.sampling import at_temperature
from draftflow.train import load_drafter

BEFORE = "8325886^"  # the commit before evaluation was chunked
torch._dynamo.config.disable = True  # as scripts/evaluate.py


def module_at(commit: str, path: str, name: str):
    source = subprocess.run(["git", "show", f"{commit}:{path}"], capture_output=True, text=True, check=True).stdout
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    before = module_at(BEFORE, "draftflow/evaluate.py", "evaluate_before")
    for run in map(Path, sys.argv[1:]):
        target = Path(read_json(run / "drafter_trained/config.json")["speculators_config"]["verifier"]["name_or_path"])
        view = run / "training_data/heldout"
        heldout = current.evaluation_samples(view)[HELDOUT]
        drafter = load_drafter(run / "drafter_trained", "sdpa")
        served, steps = {"requests": len(heldout), "max_tokens": 64}, read_json(run / "evaluation/evaluation.json")["draft_tokens"]
        generation = read_json(run / "synthetic/stats.json")["sampling"]
        for temperature in (0, 1):
            sampling, sampled_at = at_temperature(generation, temperature)["effective"], generation["effective"]["temperature"]
            old = before.evaluate(drafter, before.TargetHead(target), view, heldout, steps, served, sampling, sampled_at)
            new = current.evaluate(drafter, current.TargetHead(target), view, heldout, steps, served, sampling, sampled_at)
            identical = json.dumps(old, sort_keys=True) == json.dumps(new, sort_keys=True)
            print(f"{run.name} T={temperature}: before {old['mean_acceptance_length']:.7f}, now {new['mean_acceptance_length']:.7f}, "
                  f"{'identical' if identical else 'differ by ' + format(abs(old['mean_acceptance_length'] - new['mean_acceptance_length']), '.2e')}")  # fmt: skip


if __name__ == "__main__":
    main()
