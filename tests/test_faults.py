"""Bad input and faults: clear errors that name the file, sample or key; nothing lost."""

import json
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest
from datasets import load_from_disk

from draftflow.answers import conversation_key
from draftflow.extract import layout
from draftflow.extract.hidden_states import DiskFullError
from draftflow.extract.layout import Sample
from draftflow.extract.shards import ExtractionSettings, ShardJournal, run_shard
from draftflow.extract.transformers_backend import transformers_extractor
from draftflow.generate import check_error_rate, unresolved_errors
from draftflow.io import iter_jsonl
from draftflow.prompts import BadPromptRow
from draftflow.training_data import check_file
from draftflow.vllm_server import ServerStartError, server_env, target_server_args, vllm_server
from tests.conftest import copy_demo_run, demo_config, server_groups_gone_within, snakemake
from tests.test_example_configs import example_config
from tests.test_extraction import LAYERS, make_samples, tiny_target  # noqa: F401 - fixture
from tests.test_prompts import select


def write_rows(path, lines):
    path.write_bytes(b"".join(line if isinstance(line, bytes) else json.dumps(line).encode() + b"\n" for line in lines))
    return path


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ({"messages": []}, "empty"),
        ({"messages": [{"role": "system", "content": "only a system turn"}]}, "no user turn"),
        ({"conversations": [{"from": "gpt", "value": "an answer, no question"}]}, "no user turn"),
        (b"\xff\xfe not utf-8\n", "utf-8"),
        (b"[1, 2]\n", "not a JSON object"),
    ],
)
def test_bad_prompt_rows_name_file_and_line_or_are_skipped_and_counted(tmp_path, line, reason):
    good = {"id": "ok", "messages": [{"role": "user", "content": "hi"}]}
    path = write_rows(tmp_path / "prompts.jsonl", [good, line])
    with pytest.raises(BadPromptRow, match=rf"prompts\.jsonl, line 2: .*{reason}.*data\.on_bad_row"):
        select([path], 10, 0, "fail")
    rows, stats = select([path], 10, 0, "skip")
    assert [row["id"] for row in rows] == ["ok"] and stats.bad_rows == 1


def test_duplicate_ids_with_different_text_are_kept_apart_and_counted(tmp_path):
    rows = [{"id": "same", "messages": [{"role": "user", "content": text}]} for text in ("a", "b")]
    selected, stats = select([write_rows(tmp_path / "p.jsonl", rows)], 10, 0, "fail")
    assert len({row["id"] for row in selected}) == 2 and stats.duplicate_ids_renamed == 1


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c["vocab"].update(draft_vocab_size=200_000), "vocab.draft_vocab_size=200000 is larger"),
        (lambda c: c["extract"].update(shards=0), "shards"),
        (lambda c: c["target"].update(path="/nonexistent/model"), "/nonexistent/model"),
        (lambda c: c["extract"].update(layer_ids=[2, 40]), "extract.layer_ids [2, 40]"),
    ],
    ids=["draft vocab > target vocab", "shards < 1", "missing model path", "layer id out of range"],
)
def test_config_errors_stop_before_any_job(tmp_path, edit, message):
    config = example_config("llama-8b-1gpu.yaml", tmp_path, 32)
    (tmp_path / "target/config.json").write_text(json.dumps({"num_hidden_layers": 32, "vocab_size": 128256}))
    edit(config)
    process = snakemake(tmp_path, config, "-n", check=False)
    assert process.returncode != 0
    assert message in process.stdout + process.stderr
    assert not (tmp_path / "results").exists()


def test_server_that_cannot_start_fails_fast_with_its_log_and_leaves_nothing(tmp_path):
    log = tmp_path / "server.log"
    started = time.monotonic()
    with pytest.raises(ServerStartError, match=r"exited with code 1 before it was ready. Errors in (?s:.*)\nOSError: (?s:.*)Last lines of"):
        with vllm_server(str(tmp_path / "no-such-model"), ["--enforce-eager"], log, health_timeout_s=300):
            pass
    # 27 s measured on 2 cores busy with another suite (load 7): well before the health timeout
    assert time.monotonic() - started < 90
    assert server_groups_gone_within(log, 0)


def test_server_on_a_taken_port_fails_with_its_log(tmp_path, demo_run):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        target = str(demo_run.parents[1] / "resources/demo-target")
        with pytest.raises(ServerStartError) as error:
            with vllm_server(target, ["--enforce-eager", "--dtype", "float32"], tmp_path / "server.log", port=port, health_timeout_s=300):
                pass
    assert "Last lines of" in str(error.value)
    assert server_groups_gone_within(tmp_path / "server.log", 0)


def test_generation_fails_above_the_error_budget_and_keeps_answers(tmp_path):
    asked = [{"id": name, "messages": [{"role": "user", "content": name}]} for name in ("a", "b")]
    key = {c["id"]: conversation_key(c) for c in asked}
    errors = write_rows(tmp_path / "e.jsonl", [{"id": key["a"], "metadata": {}}, {"id": key["b"], "metadata": {}},
                                               {"id": key["a"], "metadata": {"error": "last"}}])  # fmt: skip
    unresolved = unresolved_errors([errors, tmp_path / "no-errors-yet.jsonl"], asked, answered={"b"})
    assert unresolved == [{"id": "a", "metadata": {"error": "last", "idx": 0}}]
    check_error_rate(99, 1, 0.05, errors, "generation job 0 of 1")
    with pytest.raises(RuntimeError, match=r"generation job 0 of 1: 10 of 100 conversations failed.*e\.jsonl.*rerun"):
        check_error_rate(90, 10, 0.05, errors, "generation job 0 of 1")


def test_corrupt_hidden_state_file_is_refused_by_name(tmp_path):
    path = tmp_path / "hs_7.safetensors"
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"hs_7\.safetensors \(sample s7\) does not parse"):
        check_file(path, 64, "s7")
    with pytest.raises(ValueError, match=r"has 64 bytes, its manifest says 100"):
        check_file(path, 100, "s7")


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "small-disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a size-limited tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_disk_full_stops_the_shard_clearly_and_keeps_earlier_files(tiny_target, small_disk):  # noqa: F811
    layer_ids = [2, 4, 5, LAYERS]
    samples = [Sample(i, f"s{i}", list(range(1, 200))) for i in range(20)]  # ~205 KB each in fp32
    settings = ExtractionSettings("transformers", tuple(layer_ids), "float32", "fp")
    shard_dir = small_disk / "shard-0"
    with pytest.raises(DiskFullError, match=r"Disk full while writing .*hs_s\d+\.safetensors \(.* bytes, sample s\d+\).*rerun to resume"):
        run_shard(samples, 0, shard_dir, small_disk / "hb.json", settings, lambda: transformers_extractor(
            str(tiny_target), layer_ids, dtype="float32", device="cpu", token_budget=256))
    done = ShardJournal(shard_dir, settings).completed(samples)
    assert 0 < len(done) < len(samples)
    assert sorted(p.name for p in shard_dir.glob("hs_*")) == sorted(layout.file_name(i) for i in done)
    assert not list(shard_dir.glob(".*.tmp"))


def test_generation_under_load_loses_and_duplicates_nothing(tmp_path, demo_run):
    copy_demo_run(demo_run, tmp_path)  # the demo's target
    config = demo_config(False, run="load", generate={"concurrency": 64})
    snakemake(tmp_path, config, "results/load/synthetic/stats.json")
    results = tmp_path / "results/load"
    asked = [json.loads(line)["id"] for line in (results / "prompts/conversations.jsonl").open()]
    answered = [json.loads(line)["primary_id"] for line in (results / "synthetic/generated.jsonl").open()]
    errors = [json.loads(line)["id"] for line in (results / "synthetic/errors.jsonl").open()]
    stats = json.loads((results / "synthetic/stats.json").read_text())
    assert len(answered) == len(set(answered))
    assert sorted(answered + errors) == sorted(asked)
    assert stats["errors"] == len(errors) and stats["response_tokens_per_second"] > 0


def test_external_endpoint_key_comes_from_the_environment_and_stays_out_of_logs(demo_run, tmp_path, monkeypatch):
    key = "sk-draftflow-test-4711"
    workdir = copy_demo_run(demo_run, tmp_path / "workdir").parents[1]  # the demo's target
    target = str(demo_run.parents[1] / "resources/demo-target")
    args = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "1024", "--api-key", key]
    with vllm_server(target, args, tmp_path / "external.log", env=server_env(demo_config()["vllm"], "cpu")) as external:
        config = demo_config(
            False,
            run="external",
            data={"num_samples": 12},
            generate={"endpoint": external, "api_key_env": "DRAFTFLOW_TEST_KEY"},
        )
        missing = snakemake(workdir, config, "results/external/synthetic/stats.json", check=False)
        assert missing.returncode != 0
        assert "DRAFTFLOW_TEST_KEY" in (workdir / "logs/external/generate_server-0.log").read_text()
        monkeypatch.setenv("DRAFTFLOW_TEST_KEY", key)
        snakemake(workdir, config, "results/external/synthetic/stats.json")
    stats = json.loads((workdir / "results/external/synthetic/stats.json").read_text())
    assert stats["samples"] == 12 and stats["errors"] == 0
    written = [p for p in (workdir / "logs/external").iterdir()] + list((workdir / "results/external").rglob("*.json*"))
    assert not [p for p in written if key in p.read_text(errors="replace")]


def test_chat_template_without_assistant_span_stops_prepare_naming_it(tmp_path, demo_run):
    results = copy_demo_run(demo_run, tmp_path, "prompts", "synthetic")
    template_file = Path("resources/demo-target/tokenizer_config.json")
    tokenizer_config = json.loads((tmp_path / template_file).read_text())
    tokenizer_config["chat_template"] = tokenizer_config["chat_template"].replace(
        "for message in messages", "for message in messages if message['role'] != 'assistant'"
    )
    (tmp_path / template_file).write_text(json.dumps(tokenizer_config))
    generated = (results / "synthetic/generated.jsonl").read_bytes()
    process = snakemake(tmp_path, demo_config(), "results/demo/prepared/stats.json", check=False)
    assert process.returncode != 0
    log = (tmp_path / "logs/demo/prepare.log").read_text()
    assert f"The chat template, the tokenizer's own ({template_file}), gives no assistant span" in log
    assert (results / "synthetic/generated.jsonl").read_bytes() == generated
    assert not (results / "prepared/dataset").exists()


@pytest.mark.parametrize(("on_too_long", "counted"), [("truncate", "truncated"), ("drop", "dropped_too_long")])
def test_samples_longer_than_the_max_sequence_length_are_truncated_or_dropped_and_counted(tmp_path, demo_run, on_too_long, counted):
    """Each row counted once, by what became of it: with ``truncate``, a row over the limit whose
    answer starts past it keeps no supervised token and is dropped as such (an MT-Bench second
    turn, whose prompt holds the first, can be one), not counted truncated."""
    results = copy_demo_run(demo_run, tmp_path, "prompts", "synthetic")
    rows = list(iter_jsonl(results / "synthetic/generated.jsonl"))
    limit = max(len(row["input_ids"]) for row in rows) - 8
    minimum = demo_config()["prepare"]["minimum_valid_tokens"]
    too_long = [row for row in rows if len(row["input_ids"]) > limit]
    kept_whole = [row for row in rows if on_too_long == "truncate" or len(row["input_ids"]) <= limit]
    too_few = [row for row in kept_whole if sum(row["loss_mask"][:limit]) < minimum]
    dropped_ids = {row["id"] for row in too_few}
    changed = [row for row in too_long if row["id"] not in dropped_ids] if on_too_long == "truncate" else too_long
    snakemake(tmp_path, demo_config(prepare={"max_seq_length": limit, "on_too_long": on_too_long}), "results/demo/prepared/stats.json")
    stats = json.loads((results / "prepared/stats.json").read_text())
    assert len(changed) >= 1 and (stats[counted], stats["dropped_too_few_supervised_tokens"]) == (len(changed), len(too_few))
    lengths = [len(ids) for ids in load_from_disk(str(results / "prepared/dataset"))["input_ids"]]
    assert max(lengths) <= limit and len(lengths) == len(kept_whole) - len(too_few) == stats["kept"]


def test_servers_listen_on_loopback_and_trust_no_remote_code_by_default(demo_run):
    logs = demo_run.parents[1] / "logs/demo"
    # fidelity reads vLLM's states from the extraction's files and starts no server
    assert (logs / "fidelity.server.log").read_text().startswith("No server: vLLM's states are read from ")
    server_logs = [log.read_text() for log in logs.glob("*.server.log") if log.name != "fidelity.server.log"]
    addresses = {re.search(r"Starting vLLM server on http://([^:]+):", log).group(1) for log in server_logs}
    assert len(server_logs) >= 3 and addresses == {"127.0.0.1"}
    assert all("trust_remote_code=False" in log for log in server_logs)
    vllm = {"max_model_len": 512, "tensor_parallel_size": 1, "data_parallel_size": 1, "extra_args": []}
    trusting = target_server_args(vllm, dtype="float32", device="cpu", seed=0, trust_remote_code=True)
    assert "--trust-remote-code" in trusting  # only when target.trust_remote_code is true
