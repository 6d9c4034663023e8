"""A target's identity (draftflow.fingerprint): every byte of its weights counts, and a
weight file is read once per change, its hash kept by its stat (issue 60)."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draftflow.fingerprint import (
    LARGE_HASH_BYTES,
    WEIGHT_DIGESTS,
    model_identity,
    target_fingerprint,
    uncached_weight_bytes,
)
from draftflow.plan import hashing_warning
from draftflow.vllm_registry import CACHE_DIR_ENV
from tests.twins import edit_one_tensor

NORM = "model.layers.0.input_layernorm.weight"
HOUR_NS = 3600 * 10**9
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """draftflow's cache, empty: the weight hashes a test finds there are its own."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / WEIGHT_DIGESTS


def written_an_hour_ago(path: Path) -> None:
    """As a downloaded or trained target's files are: older than a write still under way."""
    mtime = path.stat().st_mtime_ns - HOUR_NS
    os.utime(path, ns=(mtime, mtime))


def small_target(folder: Path) -> Path:
    """A config and one weight file of three tensors (49,216 values), written an hour ago."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(512, 64, generator=generator),
        NORM: torch.ones(64),
        "model.layers.0.mlp.up_proj.weight": torch.randn(256, 64, generator=generator),
    }
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    written_an_hour_ago(folder / "model.safetensors")
    return folder


def test_one_tensor_edited_in_place_changes_the_identity(tmp_path, cache):
    target = small_target(tmp_path / "target")
    weights = target / "model.safetensors"
    before, size = model_identity(target), weights.stat().st_size
    edit_one_tensor(weights, NORM)  # a fix of one norm: 64 of the 49,216 values, over the old file
    assert weights.stat().st_size == size
    assert model_identity(target) != before


def test_an_unchanged_file_is_hashed_once_and_then_only_stated(tmp_path, cache):
    target = small_target(tmp_path / "target")
    weights = target / "model.safetensors"
    assert uncached_weight_bytes(target) == weights.stat().st_size
    first = target_fingerprint(target)
    assert [entry.read_text() for entry in cache.iterdir()] == [hashlib.sha256(weights.read_bytes()).hexdigest()]
    assert uncached_weight_bytes(target) == 0
    # Other bytes under the same stat (written in place, the mtime put back): an identity that
    # read the file would change. It does not: the second call read no weight byte. (The
    # limit this shows: a write that puts the mtime back is not seen, as by make.)
    stat = weights.stat()
    with weights.open("r+b") as stream:
        stream.seek(stat.st_size - 4)
        stream.write(b"\xff\xff\xff\xff")
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert target_fingerprint(target) == first


def test_a_copy_in_another_folder_is_the_same_target_after_one_hash(tmp_path, cache):
    target = small_target(tmp_path / "target")
    first = target_fingerprint(target)
    copy = shutil.copytree(target, tmp_path / "elsewhere/target")  # new inodes, the same bytes
    assert uncached_weight_bytes(copy) == (copy / "model.safetensors").stat().st_size
    assert target_fingerprint(copy) == first
    assert uncached_weight_bytes(copy) == 0 and len(list(cache.iterdir())) == 2


def test_a_file_written_just_now_is_hashed_again_next_time(tmp_path, cache):
    """A second write within the file system's timestamp tick would leave the stat as it was."""
    target = small_target(tmp_path / "target")
    os.utime(target / "model.safetensors")  # written now
    model_identity(target)
    assert not cache.exists() and uncached_weight_bytes(target) > 0


def test_a_hub_snapshot_counts_by_its_commit_and_is_never_hashed(tmp_path, cache):
    snapshot = small_target(tmp_path / "hub/models--org--name/snapshots" / COMMIT)
    assert uncached_weight_bytes(snapshot) == 0
    model_identity(snapshot)
    assert not cache.exists()


def test_a_large_target_is_hashed_with_a_bar_and_the_plan_says_so_first(tmp_path, cache, capsys):
    target = tmp_path / "target"
    target.mkdir()
    weights = target / "model.safetensors"
    with weights.open("wb") as stream:  # sparse: a GiB of zeros that takes no disk
        stream.truncate(LARGE_HASH_BYTES + 1)
    written_an_hour_ago(weights)
    assert hashing_warning(uncached_weight_bytes(target)) == [
        "hashing 1.07 GB of the target's weights once, to see any edit of them "
        "(cached after: later plans and runs read none of them)"
    ]
    model_identity(target)
    assert "hashing the target's weights (once; cached after)" in capsys.readouterr().err
    assert hashing_warning(uncached_weight_bytes(target)) == []
