"""target.path as a Hugging Face id, resolved offline through a hub cache the tests build
(models--org--name/{blobs,refs,snapshots}); nothing is downloaded."""

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from huggingface_hub import constants
from safetensors.numpy import save

from draftflow.fingerprint import target_fingerprint
from draftflow.progress import target_model
from draftflow.provenance import provenance
from draftflow.target_source import HubRevision, TargetNotFoundError, resolve_target
from tests.conftest import demo_config, snakemake

REPO_ID = "tiny-org/tiny-llama"
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def tiny_llama_files(weight: float) -> dict[str, bytes]:
    """A Llama-shaped target's config, tokenizer settings and head weights."""
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": 16,
        "vocab_size": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "eos_token_id": 2,
    }  # fmt: skip
    weights = {name: np.full((256, 16), weight, np.float32) for name in ("model.embed_tokens.weight", "lm_head.weight")}
    return {
        "config.json": json.dumps(config).encode(),
        "tokenizer_config.json": json.dumps({"eos_token": "</s>"}).encode(),
        "model.safetensors": save({**weights, "model.norm.weight": np.ones(16, np.float32)}),
    }


def add_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, bytes], refs: tuple[str, ...]) -> Path:
    """One commit of ``repo_id`` in huggingface_hub's cache layout: blobs, snapshot links to them, refs."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, content in files.items():
        blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
        blob.write_bytes(content)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """HF_HOME with the tiny target at two commits: main and tag v1 at A; B only by its hash, other weights."""
    home = tmp_path / "hf-home"
    cache = home / "hub"
    add_snapshot(cache, REPO_ID, COMMIT_A, tiny_llama_files(0.0), refs=("main", "v1"))
    add_snapshot(cache, REPO_ID, COMMIT_B, tiny_llama_files(1.0), refs=())
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # huggingface_hub read the environment at import
    return cache


def snapshot(cache: Path, commit: str) -> Path:
    return cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / commit


def move_main(cache: Path, commit: str) -> None:
    (cache / f"models--{REPO_ID.replace('/', '--')}" / "refs" / "main").write_text(commit)


def test_ids_resolve_to_the_snapshot_of_their_revision(hub_cache):
    for path, revision, commit in [
        (REPO_ID, "main", COMMIT_A), (f"{REPO_ID}@main", "main", COMMIT_A), (f"{REPO_ID}@v1", "v1", COMMIT_A),
        (f"{REPO_ID}@{COMMIT_A}", COMMIT_A, COMMIT_A), (f"{REPO_ID}@{COMMIT_B}", COMMIT_B, COMMIT_B),
    ]:  # fmt: skip
        source = resolve_target(path)
        assert (source.folder, source.hub) == (snapshot(hub_cache, commit), HubRevision(REPO_ID, revision, commit))
    move_main(hub_cache, COMMIT_B)
    assert resolve_target(REPO_ID).folder == snapshot(hub_cache, COMMIT_B)
    assert target_model({"target": {"path": f"{REPO_ID}@v1"}}).num_layers == 8  # the progress check reads it too


def test_local_folders_win_over_ids(hub_cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / REPO_ID).mkdir(parents=True)
    assert resolve_target(REPO_ID).hub is None
    assert resolve_target("resources/demo-target", workflow_builds=["resources/demo-target"]).hub is None
    assert resolve_target("../target").hub is None and resolve_target("/abs/path/to/target").hub is None


def test_fingerprint_and_provenance_change_with_the_commit(hub_cache, tmp_path):
    at_a, at_b = snapshot(hub_cache, COMMIT_A), snapshot(hub_cache, COMMIT_B)
    # Same config and tokenizer files: only the id and commit tell A from B.
    assert target_fingerprint(at_a) != target_fingerprint(at_b)
    assert target_fingerprint(resolve_target(f"{REPO_ID}@main").folder) == target_fingerprint(at_a)
    local_copy = tmp_path / "local"
    local_copy.mkdir()
    for file in at_a.iterdir():
        (local_copy / file.name).write_bytes(file.read_bytes())
    assert target_fingerprint(local_copy) not in (target_fingerprint(at_a), target_fingerprint(at_b))

    source = resolve_target(f"{REPO_ID}@v1")
    record = provenance({"target": {"path": f"{REPO_ID}@v1"}}, source.folder, source.hub_record(), {})
    assert record["target"] == {
        "path": str(at_a),
        "hub": {"repo_id": REPO_ID, "revision": "v1", "commit": COMMIT_A},
        "fingerprint": target_fingerprint(at_a),
    }


def hub_config(tmp_path: Path, target: str) -> dict:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    return demo_config(False, run="hub", target={"path": target}, data={"prompt_files": [str(prompts)]})


def rule_inputs(dry_run_output: str, rule: str) -> list[str]:
    return re.search(rf"^rule {rule}:\n    input: (.*)$", dry_run_output, flags=re.MULTILINE)[1].split(", ")


def test_the_workflow_takes_the_snapshot_folder_and_reruns_on_a_new_commit(hub_cache, tmp_path):
    config = hub_config(tmp_path, f"{REPO_ID}@main")
    dry_run = snakemake(tmp_path, config, "-n").stdout
    for rule in ("generate", "prepare", "vocab_map", "provenance"):
        assert str(snapshot(hub_cache, COMMIT_A)) in rule_inputs(dry_run, rule)
    snakemake(tmp_path, config, "--touch")  # records each job's inputs, runs nothing

    def changed_inputs(config) -> set[str]:
        return set(snakemake(tmp_path, config, "--list-changes", "input").stdout.split())

    assert not changed_inputs(config)
    move_main(hub_cache, COMMIT_B)
    changed = changed_inputs(config)
    reading_the_target = {"synthetic/generated.jsonl", "vocab/d2t.npy", "provenance.json"}
    assert {f"results/hub/{path}" for path in reading_the_target} <= changed
    assert "results/hub/prompts/conversations.jsonl" not in changed
    assert not changed_inputs(hub_config(tmp_path, f"{REPO_ID}@{COMMIT_A}"))  # pinned to the commit run before


@pytest.mark.parametrize("target", ["tiny-org/absent", f"{REPO_ID}@v9", f"{REPO_ID}@{'c' * 40}"])
def test_a_model_missing_from_the_cache_stops_before_any_job(hub_cache, tmp_path, target):
    repo_id, _, revision = target.partition("@")
    refused = snakemake(tmp_path, hub_config(tmp_path, target), check=False)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert f"target.path {target!r}" in output and str(hub_cache) in output
    assert f"hf download {repo_id} --revision {revision or 'main'}" in output
    assert not (tmp_path / "results").exists() and not (tmp_path / "logs").exists()
    with pytest.raises(TargetNotFoundError, match=re.escape(f"hf download {repo_id} --revision")):
        resolve_target(target)
