"""The vLLM server dies mid-stage: the client retries, the rule fails saying so,
finished work is kept, no server process is left and a rerun resumes."""

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from draftflow.answers import conversation_key
from draftflow.extract import layout
from draftflow.io import iter_jsonl
from draftflow.vllm_server import free_port, logged_server_pids
from tests.conftest import (complete_lines, copy_demo_run, demo_config, server_groups_gone_within, snakemake, start_snakemake,
                            wait_for_exit, wait_until)  # fmt: skip
from tests.test_extract_stage import assert_manifests_match_files

pytestmark = pytest.mark.slow


def kill_server_during(workdir: Path, config: dict, target: str, server_log: str, ready, moment: str) -> int:
    """Run the workflow to ``target`` and, once ``ready()`` holds, SIGKILL the API process of
    the server it started (its pid from ``server_log``; not its engine workers).

    Returns the workflow's exit code.
    """
    process = start_snakemake(workdir, config, target)
    wait_until(ready, process, moment)
    os.kill(logged_server_pids((workdir / server_log).read_text())[-1], signal.SIGKILL)
    return wait_for_exit(process, 600)


def partial_generation(results: Path) -> Path:
    work = results / "synthetic/work"
    return next(work.glob("answers-*.job-0.jsonl"), work / "not-yet.jsonl")  # not .errors.jsonl


def test_server_killed_mid_generation_fails_clearly_and_a_rerun_resumes(tmp_path, demo_run):
    results = copy_demo_run(demo_run, tmp_path)
    generate = {"concurrency": 4, "max_retries": 1}  # one retry, 2 s after the failure: a short wait
    config = demo_config(False, data={"num_samples": 60}, generate=generate, vllm={"port": free_port("127.0.0.1")})
    target = "results/demo/synthetic/stats.json"
    server_log = "logs/demo/generate_server-0.server.log"
    code = kill_server_during(tmp_path, config, target, server_log, lambda: complete_lines(partial_generation(results)) >= 10, "10 answers")

    partial = partial_generation(results)
    answered = {row["primary_id"] for row in iter_jsonl(partial)}  # conversation keys, as the store files them
    log = (tmp_path / "logs/demo/generate_server-0.log").read_text()
    assert code != 0
    assert "Retrying in" in log
    assert "died during generation: it stayed down past the client's retries with backoff (generate.max_retries=1)" in log
    assert f"The {len(answered)} conversations answered so far are kept in {partial.relative_to(tmp_path)}; rerun" in log
    assert 10 <= len(answered) < 60
    assert server_groups_gone_within(tmp_path / server_log, 30), "the killed server's engine workers outlived the rule"

    snakemake(tmp_path, config, target)
    asked = [row["id"] for row in iter_jsonl(results / "prompts/conversations.jsonl")]
    generated = [row["primary_id"] for row in iter_jsonl(results / "synthetic/generated.jsonl")]
    assert sorted(generated) == sorted(asked) and len(asked) == 60
    keys = {row["id"]: conversation_key(row) for row in iter_jsonl(results / "prompts/conversations.jsonl")}
    assert answered <= {keys[conversation] for conversation in generated} and complete_lines(results / "synthetic/errors.jsonl") == 0
    log = (tmp_path / "logs/demo/generate_server-0.log").read_text()
    asked_again = re.findall(r"Pipeline complete in [\d.]+s: (\d+) conversations", log)
    assert asked_again == [str(60 - len(answered))]


def test_server_killed_mid_extraction_fails_clearly_and_a_rerun_resumes(tmp_path, demo_run):
    results = copy_demo_run(demo_run, tmp_path, "prompts", "synthetic", "prepared")
    extract = {"shards": 1, "concurrency": 1, "max_retries": 1}
    config = demo_config(extract=extract, vllm={"port": free_port("127.0.0.1")})
    target = "results/demo/hidden_states/server-0.json"
    journal = results / "hidden_states/shard-0/journal.jsonl"
    server_log = "logs/demo/extract_server-0.server.log"
    code = kill_server_during(tmp_path, config, target, server_log, lambda: complete_lines(journal) > 10, "11 journal records")

    journaled = [json.loads(line)["sample_id"] for line in journal.read_text().splitlines()[1:]]
    total = json.loads((results / "hidden_states/plan.json").read_text())["samples"]
    on_disk = sorted(p.name for p in (results / "hidden_states/shard-0").glob("hs_*.safetensors"))
    log = (tmp_path / "logs/demo/extract_server-0.log").read_text()
    assert code != 0
    assert "Retrying in" in log
    assert "died during extraction: sample" in log and "retried with backoff (extract.max_retries=1)" in log
    assert "rerun to resume the shard" in log
    assert "logs/demo/extract_server-0.server.log" in log
    assert on_disk == sorted(layout.file_name(sample_id) for sample_id in journaled)
    assert 10 <= len(journaled) < total
    assert server_groups_gone_within(tmp_path / server_log, 30), "the killed server's engine workers outlived the job"

    snakemake(tmp_path, config, target)
    log = (tmp_path / "logs/demo/extract_server-0.log").read_text()
    assert f"shard 0: {len(journaled)} of {total} samples already on disk" in log
    assert_manifests_match_files(results)


@pytest.mark.parametrize(
    ("vllm", "message"),
    [
        ({"health_timeout_s": 1}, "raise vllm.health_timeout_s"),  # the server is still loading after 1 s
        ({"extra_args": ["--no-such-flag"]}, "before it was ready"),  # the engine exits at start
    ],
    ids=["start timeout", "exits at start"],
)
def test_a_server_that_never_serves_fails_the_generate_rule_and_leaves_no_process(tmp_path, demo_run, vllm, message):
    results = copy_demo_run(demo_run, tmp_path, "prompts")
    port = free_port("127.0.0.1")
    config = demo_config(vllm={"port": port, **vllm})
    process = snakemake(tmp_path, config, "results/demo/synthetic/stats.json", check=False)
    assert process.returncode != 0
    log = (tmp_path / "logs/demo/generate_server-0.log").read_text()
    assert message in log and "logs/demo/generate_server-0.server.log" in log
    assert not (results / "synthetic/stats.json").exists()
    assert server_groups_gone_within(tmp_path / "logs/demo/generate_server-0.server.log", 0)


def test_errors_from_a_live_server_count_against_the_budget_and_a_rerun_asks_only_them(tmp_path, demo_run):
    """The server refuses 2 of 20 conversations (HTTP 400): its chat template, the demo's
    behind a guard given with --chat-template, raises on them as a template raises on a
    role it does not know. Above the budget the rule fails keeping the answers; below it
    the rule passes naming them. (A prompt too long for vllm.max_model_len is no such
    error: it is never sent, test_twin_workflows.py.)"""
    results = copy_demo_run(demo_run, tmp_path)
    refused = {"demo-refused-a", "demo-refused-b"}
    rows = [{"id": f"demo-short-{i:02d}", "messages": [{"role": "user", "content": f"Describe module number {i}."}]}
            for i in range(18)] + [{"id": sample, "messages": [{"role": "user", "content": f"REFUSE {sample}"}]}
                                  for sample in sorted(refused)]  # fmt: skip
    prompts = tmp_path / "resources/budget-prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    demo_template = json.loads((tmp_path / "resources/demo-target/tokenizer_config.json").read_text())["chat_template"]
    template = tmp_path / "resources/refusing.jinja"
    template.write_text("{%- for m in messages %}{% if 'REFUSE' in m['content'] %}{{ raise_exception('refused by the "
                        "test template') }}{% endif %}{% endfor -%}" + demo_template)  # fmt: skip
    target = "results/demo/synthetic/stats.json"

    def generate(max_error_fraction: float) -> subprocess.CompletedProcess:
        config = demo_config(False, data={"prompt_files": [str(prompts.relative_to(tmp_path))], "num_samples": 20},
                             # the demo target gives these out-of-domain prompts one answer: flawed, and not this test's point
                             generate={"max_error_fraction": max_error_fraction, "max_retries": 1, "max_degenerate_fraction": 1.0},
                             vllm={"port": free_port("127.0.0.1"), "extra_args": ["--chat-template", str(template)]})  # fmt: skip
        return snakemake(tmp_path, config, target, check=False)

    assert generate(0.05).returncode != 0
    log = (tmp_path / "logs/demo/generate_server-0.log").read_text()
    partial = partial_generation(results)
    assert "2 of 20 conversations failed (more than generate.max_error_fraction=0.05)" in log
    assert f"their errors are in {partial.with_name(partial.stem + '.errors.jsonl').relative_to(tmp_path)}" in log
    assert {row["primary_id"] for row in iter_jsonl(partial)} == {conversation_key(row) for row in rows if row["id"] not in refused}
    assert not (results / "synthetic/generated.jsonl").exists()

    assert generate(0.1).returncode == 0
    log = (tmp_path / "logs/demo/generate_server-0.log").read_text()
    assert re.findall(r"Pipeline complete in [\d.]+s: (\d+) conversations \((\d+) ok", log) == [("2", "0")]
    assert {row["id"] for row in iter_jsonl(results / "synthetic/errors.jsonl")} == refused
    assert all("refused by the test template" in row["metadata"]["error"] for row in iter_jsonl(results / "synthetic/errors.jsonl"))
    assert len(list(iter_jsonl(results / "synthetic/generated.jsonl"))) == 18
    assert json.loads((results / "synthetic/stats.json").read_text())["errors"] == 2
