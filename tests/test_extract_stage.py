"""Hidden-state extraction on the demo, through Snakemake and the vLLM CPU backend."""

import json
import re
import subprocess

import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file
from speculators.train.data import ArrowDataset

from draftflow.extract.fidelity import relative_errors
from draftflow.extract.layout import Sample
from draftflow.extract.transformers_backend import TransformersExtractor, load_target
from draftflow.fingerprint import file_sha256
from draftflow.vllm_server import free_port
from tests.conftest import (DRAFTFLOW, complete_lines, copy_demo_run, demo_config, pause_group, server_groups_gone_within, snakemake,
                            start_snakemake, stop_group, wait_until)  # fmt: skip

pytestmark = pytest.mark.slow


def manifests(results):
    shards = json.loads((results / "hidden_states/plan.json").read_text())["num_shards"]
    return [json.loads((results / f"hidden_states/shard-{k}.json").read_text()) for k in range(shards)]


def assert_manifests_match_files(results):
    plan = json.loads((results / "hidden_states/plan.json").read_text())
    listed = []
    for manifest in manifests(results):
        shard_dir = results / "hidden_states" / f"shard-{manifest['shard']}"
        on_disk = sorted(p.name for p in shard_dir.glob("hs_*.safetensors"))
        assert on_disk == sorted(entry["file"].split("/")[1] for entry in manifest["files"])
        assert not list(shard_dir.glob(".*.tmp"))
        for entry in manifest["files"]:
            path = results / "hidden_states" / entry["file"]
            assert path.stat().st_size == entry["bytes"]
            assert file_sha256(path) == entry["sha256"]
        listed += [entry["sample_id"] for entry in manifest["files"]]
    planned = [sample_id for shard in plan["shards"] for sample_id, _, _ in shard["samples"]]
    assert sorted(listed) == sorted(planned) and len(planned) == plan["samples"]


def test_shards_hold_every_sample_once_in_speculators_format(demo_run):
    assert_manifests_match_files(demo_run)
    manifest = manifests(demo_run)[0]
    assert manifest["layer_ids"] == [2, 4, 5, 8]
    assert manifest["backend"] == "vllm" and manifest["dtype"] == "float32"
    entry = manifest["files"][0]
    payload = load_file(demo_run / "hidden_states" / entry["file"])
    assert payload["hidden_states"].shape == (entry["tokens"], 4, manifest["hidden_size"])
    assert payload["token_ids"].dtype == torch.int64
    plan = json.loads((demo_run / "hidden_states/plan.json").read_text())
    actual = sum(m["bytes"] for m in manifests(demo_run))
    assert 0 <= plan["bytes"] - actual <= 256 * plan["samples"]


def test_backends_agree_on_the_demo(demo_run):
    fidelity = json.loads((demo_run / "fidelity/fidelity.json").read_text())
    assert fidelity["passed"]
    assert max(fidelity["max_relative_error_per_layer"].values()) < 1e-5
    greedy = fidelity["greedy_agreement"]  # the demo answers greedily
    masks = load_from_disk(str(demo_run / "prepared/dataset")).with_format(None)["loss_mask"][: fidelity["samples"]]
    assert greedy["passed"] and greedy["answer_tokens"] == sum(map(sum, masks))
    assert greedy["share"] >= 0.99


def test_one_packed_batch_gives_each_demo_sample_the_states_of_the_sample_alone(demo_run):
    """The transformers backend runs a batch's samples end to end in one row; on the demo
    target in float32 each sample's states are those of the sample run alone."""
    model = load_target(str(demo_run.parents[1] / "resources/demo-target"), dtype=torch.float32).eval()
    by_length = sorted(load_from_disk(str(demo_run / "prepared/dataset")).with_format(None)["input_ids"], key=len)
    rows = by_length[:12] + by_length[-12:]  # the shortest and the longest samples in one batch
    assert max(map(len, rows)) > 1.5 * min(map(len, rows))
    layer_ids = manifests(demo_run)[0]["layer_ids"]
    extractor = TransformersExtractor(model, layer_ids, token_budget=sum(map(len, rows)), device="cpu")
    extracted = {sample.index: states for sample, states in extractor([Sample(i, f"row-{i}", ids) for i, ids in enumerate(rows)])}
    assert extractor.timings["batches"] == 1 and extractor.timings["padded_tokens"] == extractor.timings["tokens"]
    extractor.close()
    with torch.inference_mode():
        for index, token_ids in enumerate(rows):
            hidden = model(input_ids=torch.tensor([token_ids]), output_hidden_states=True).hidden_states
            expected = torch.stack([*(hidden[k][0] for k in layer_ids[:-1]), hidden[-1][0]], dim=1)
            states = extracted[index]
            got = torch.cat([states[:, :-1], model.model.norm(states[:, -1])[:, None]], dim=1)
            assert max(relative_errors(expected, got)) < 1e-5, index


def test_training_view_loads_in_speculators_dataset(demo_run):
    dataset = ArrowDataset(max_len=2048, datapath=str(demo_run / "training_data/train"), on_missing="raise", hidden_states_dtype=torch.float32)
    sample = dataset[0]
    hidden = json.loads((demo_run / "hidden_states/plan.json").read_text())["hidden_size"]
    assert sample["hidden_states"].shape[1] == 3 * hidden
    assert sample["verifier_last_hidden_states"].shape[1] == hidden
    assert sample["loss_mask"].sum() > 0


def test_a_killed_server_job_resumes_each_of_its_shards_from_its_journal(tmp_path, demo_run):
    """The demo's one server job holds both shards; SIGKILL it while shard 1
    extracts (shard 0 finished); the rerun keeps shard 0, resumes shard 1."""
    results = copy_demo_run(demo_run, tmp_path, "prompts", "synthetic", "prepared", "hidden_states")
    hidden_states = results / "hidden_states"
    assert json.loads((hidden_states / "plan.json").read_text())["servers"] == 1
    shard_dir = hidden_states / "shard-1"
    for output in ("server-0.json", "shard-0.json", "shard-1.json", "manifest.json"):
        (hidden_states / output).unlink()
    for path in shard_dir.iterdir():
        path.unlink()
    shard_0_files = sorted(p.name for p in (hidden_states / "shard-0").glob("hs_*.safetensors"))
    config = demo_config(vllm={"port": free_port("127.0.0.1")})
    process = start_snakemake(tmp_path, config, "--cores", "1", "extract")
    journal = shard_dir / "journal.jsonl"
    wait_until(lambda: complete_lines(journal) >= 12, process, "shard 1's 11th file")
    # the job stopped where it is while the progress checks look (they take seconds
    # on a busy machine, time enough for the shard to finish), then killed
    pause_group(process)
    done_before_kill = complete_lines(journal) - 1
    assert (results / "run_plan.json").exists()  # the target existed: the run wrote its plan beside the stages
    during = [progress_report(tmp_path, folder) for folder in ("results/demo", "results/demo/hidden_states")]
    stop_group(process)
    assert 10 < done_before_kill < 100, "the kill did not land mid-shard"
    planned = json.loads((hidden_states / "plan.json").read_text())["samples"]
    for report in during:
        assert not report["complete"] and report["samples_total"] == planned
        assert len(shard_0_files) + 11 <= report["samples_done"] <= len(shard_0_files) + done_before_kill

    snakemake(tmp_path, config, "--unlock")  # a killed Snakemake leaves its lock
    rerun = snakemake(tmp_path, config, "extract", "--rerun-incomplete")
    assert rerun.returncode == 0
    log = (tmp_path / "logs/demo/extract_server-0.log").read_text()
    on_disk = dict(re.findall(r"shard (\d): (\d+ of \d+) samples already on disk", log))  # the rerun's, last
    assert on_disk["0"] == f"{len(shard_0_files)} of {len(shard_0_files)}"
    assert int(on_disk["1"].split()[0]) >= done_before_kill
    heartbeats = [json.loads((hidden_states / f"shard-{k}.heartbeat.json").read_text()) for k in (0, 1)]
    assert [h["loads_model"] for h in heartbeats] == [False, True]  # one load, for the shard with work left
    assert sorted(p.name for p in (hidden_states / "shard-0").glob("hs_*.safetensors")) == shard_0_files
    assert_manifests_match_files(results)
    for folder in ("results/demo", "results/demo/hidden_states"):
        after = progress_report(tmp_path, folder)
        assert after["complete"] and after["samples_done"] == after["samples_total"] == planned
    assert server_groups_gone_within(tmp_path / "logs/demo/extract_server-0.server.log", 60), "a vLLM server outlived its killed job"


def progress_report(workdir, folder):
    """docs/plan-and-progress.md's progress command, run in the run's working directory; its JSON."""
    command = [str(DRAFTFLOW), "progress", folder, "--json"]
    checked = subprocess.run(command, capture_output=True, text=True, cwd=workdir)
    assert checked.returncode == 0, checked.stderr
    return json.loads(checked.stdout)
