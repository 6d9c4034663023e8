"""Held-out split and the directory layout speculators' trainer reads.

speculators' ``ArrowDataset`` reads a saved dataset and its hidden states as
``<dataset>/hidden_states/hs_{row}.safetensors``. A view is such a directory
for a subset of samples: the selected rows, renumbered, with symlinks to the
shard files, so no hidden state is copied.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from datasets import load_from_disk

from draftflow.extract.layout import file_name
from draftflow.extract.hidden_states import opens_cleanly
from draftflow.io import atomic_path, read_json


def is_heldout(sample_id: str, fraction: float, seed: int) -> bool:
    """Stable per-sample split: depends on the id and seed only."""
    digest = hashlib.sha256(f"heldout:{seed}:{sample_id}".encode()).hexdigest()
    return int(digest[:12], 16) / 16**12 < fraction


def hidden_state_files(summary_path: Path) -> dict[int, tuple[Path, int]]:
    """Dataset row → (its file, its size in bytes), from the shard manifests the
    extraction's summary (``hidden_states/manifest.json``) lists."""
    base = summary_path.parent
    files = {}
    for manifest in read_json(summary_path)["shards"]:
        for entry in read_json(base / manifest)["files"]:
            files[entry["index"]] = (base / entry["file"], entry["bytes"])
    return files


def check_file(path: Path, size: int, sample_id: str) -> None:
    """Refuse a missing, resized or unparsable hidden-state file, naming it."""
    problem = (
        "is missing" if not path.exists()
        else f"has {path.stat().st_size:,} bytes, its manifest says {size:,}" if path.stat().st_size != size
        else "does not parse as safetensors" if not opens_cleanly(path)
        else None
    )  # fmt: skip
    if problem:
        raise ValueError(
            f"Hidden-state file {path} (sample {sample_id}) {problem}. Delete it and run "
            "`snakemake --forcerun extract_server`: shards keep the files their journal "
            "vouches for and extract the missing ones again."
        )


def build_view(
    dataset_dir: Path, files: dict[int, tuple[Path, int]], rows: list[int], view_dir: Path
) -> None:
    """Save ``rows`` of the dataset to ``view_dir`` with symlinked hidden states."""
    dataset = load_from_disk(str(dataset_dir)).select(rows)
    with atomic_path(view_dir) as tmp:
        dataset.save_to_disk(str(tmp))
        links = tmp / "hidden_states"
        links.mkdir()
        final_links = (view_dir / "hidden_states").resolve()
        for position, row in enumerate(rows):
            source, size = files[row]
            check_file(source, size, dataset[position]["sample_id"])
            (links / file_name(position)).symlink_to(os.path.relpath(source.resolve(), final_links))


def split_rows(dataset_dir: Path, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train rows, held-out rows) of the prepared dataset."""
    sample_ids = load_from_disk(str(dataset_dir)).with_format(None)["sample_id"]
    heldout = [i for i, s in enumerate(sample_ids) if is_heldout(s, fraction, seed)]
    train = [i for i, s in enumerate(sample_ids) if not is_heldout(s, fraction, seed)]
    return train, heldout
