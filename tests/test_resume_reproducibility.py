"""Two uninterrupted runs of one config make the same files; a run killed during
generation and during training resumes to exactly the drafter of an uninterrupted one."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from draftflow.config import load_config
from draftflow.io import iter_jsonl
from draftflow.plan import build_plan, rates_from_run
from draftflow.report import read_benchmark
from tests.compare import assert_same_files
from tests.conftest import REPO, SNAKEMAKE, demo_config, snakemake

pytestmark = pytest.mark.slow


def start_workflow(workdir: Path, config: dict) -> subprocess.Popen:
    config_path = workdir / f"config-{config['run']}.yaml"
    config_path.write_text(json.dumps(config))
    command = [str(SNAKEMAKE), "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
               "--configfile", str(config_path), "--cores", "2", "--rerun-incomplete"]  # fmt: skip
    return subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def kill_when(process: subprocess.Popen, ready, timeout_s: float = 600):
    """SIGKILL the workflow's process group as soon as ``ready()`` holds."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert process.poll() is None, "the workflow ended before the moment to kill it"
        assert time.monotonic() < deadline, "the moment to kill never came"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    unlock = [*process.args[:-1], "--unlock"]  # a killed Snakemake leaves its lock
    subprocess.run(unlock, check=True, capture_output=True)


def lines(path_pattern: Path) -> int:
    files = list(path_pattern.parent.glob(path_pattern.name))
    return sum(1 for _ in files[0].open()) if files else 0


def test_two_uninterrupted_runs_make_the_same_files(demo_run, second_demo_run):
    """Every file the same bytes, those written in completion order the same lines,
    the stats the same but for their timings."""
    compared = assert_same_files(demo_run, second_demo_run, {b"results/again": b"results/demo"})
    assert {"synthetic/generated.jsonl", "evaluation/evaluation.json", "drafter/model.safetensors"} <= compared
    assert len(compared) > 500


@pytest.fixture(scope="module")
def repeat_run(workdir, demo_run):
    """The demo config under another run name, killed twice along the way."""
    config = demo_config(run="repeat")
    results = workdir / "results/repeat"
    partial = results / "synthetic/work/answers-????????????????.jsonl"  # not .errors.jsonl
    kill_when(start_workflow(workdir, config), lambda: lines(partial) >= 40)
    answered_before_kill = lines(partial)
    checkpoint = results / "train/work/checkpoint.pt"
    kill_when(start_workflow(workdir, config), checkpoint.exists)
    snakemake(workdir, config, "--rerun-incomplete")
    return results, answered_before_kill


def test_generation_resumed_without_losing_or_duplicating_samples(workdir, repeat_run):
    results, answered_before_kill = repeat_run
    ids = [row["primary_id"] for row in iter_jsonl(results / "synthetic/generated.jsonl")]
    assert len(ids) == len(set(ids)) == demo_config()["data"]["num_samples"]
    log = (workdir / "logs/repeat/generate.log").read_text()
    regenerated = int(log.rsplit("Pipeline complete in", 1)[1].split(": ", 1)[1].split(" conversations")[0])
    assert regenerated <= len(ids) - answered_before_kill


def test_training_resumed_from_its_checkpoint(workdir, repeat_run):
    assert "resuming at epoch" in (workdir / "logs/repeat/train.log").read_text()


def test_a_killed_and_resumed_run_gives_the_uninterrupted_runs_results(demo_run, repeat_run):
    repeat, _ = repeat_run
    for name in ("vocab/d2t.npy", "vocab/t2d.npy"):
        np.testing.assert_array_equal(np.load(demo_run / name), np.load(repeat / name))
    for shard in range(demo_config()["extract"]["shards"]):
        first, second = (json.loads((r / f"hidden_states/shard-{shard}.json").read_text()) for r in (demo_run, repeat))
        assert [f["sha256"] for f in first["files"]] == [f["sha256"] for f in second["files"]]
    first, second = (load_file(r / "drafter/model.safetensors") for r in (demo_run, repeat))
    assert first.keys() == second.keys()
    assert all((first[k] == second[k]).all() for k in first)
    evaluations = [json.loads((r / "evaluation/evaluation.json").read_text()) for r in (demo_run, repeat)]
    assert evaluations[0]["trained"] == evaluations[1]["trained"]


def test_provenance_records_config_code_and_inputs(repeat_run):
    results, _ = repeat_run
    provenance = json.loads((results / "provenance.json").read_text())
    assert provenance["config"]["run"] == "repeat"
    assert len(provenance["target"]["fingerprint"]) == 64
    assert provenance["packages"]["speculators"] == "0.9.0"
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    assert provenance["workflow_commit"].split(" ")[0] == head.stdout.strip()  # " (uncommitted changes)" may follow
    assert set(provenance["stage_inputs"]) >= {"generate", "extract_server", "train", "evaluate"}
    assert all(len(digest) == 64 for digest in provenance["stage_inputs"]["train"].values())


def test_the_plan_fed_the_demo_runs_rates_foretells_the_repeat_runs_time(workdir, demo_run, repeat_run):
    """The demo ran first; its rates predict the repeat run (same config) within 50% in total
    over the stages that ran once (generate and train were killed and resumed: their
    benchmarks time only the last attempt). Loose on purpose: a stage's time varies with
    what the other test worker runs on the same two cores."""
    results, _ = repeat_run
    plan = build_plan(load_config(workdir / "config-repeat.yaml"), results, rates_from_run(demo_run), local_gpus=0)
    planned = {stage.name: stage.seconds for stage in plan.stages}
    stages = ("prepare", "vocab_map", "extract_server", "drafter_init", "evaluate", "serve_check")
    measured = {stage: read_benchmark(workdir / "benchmarks/repeat" / f"{stage}{'-0' if stage == 'extract_server' else ''}.tsv")["seconds"]
                for stage in stages}  # fmt: skip
    assert sum(planned[stage] for stage in stages) == pytest.approx(sum(measured.values()), rel=0.5), (planned, measured)
