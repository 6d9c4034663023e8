"""Held-out split and the directory layout speculators' trainer reads.

speculators' ``ArrowDataset`` reads a saved dataset and its hidden states as
``<dataset>/hidden_states/hs_{row}.safetensors``. A view is such a directory
for a subset of samples: the selected rows, renumbered, with symlinks to the
shard files (found by sample id), so no hidden state is copied.

speculators compares each file's token ids with its row and skips a sample
that differs, with a warning; here a difference is an error, named before
training or evaluation reads anything.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from datasets import load_from_disk

from draftflow.extract.hidden_states import opens_cleanly, read_hidden_states, read_token_ids
from draftflow.extract.layout import SUMMARY, Sample, token_digest, view_file_name
from draftflow.fingerprint import file_sha256
from draftflow.io import atomic_path, read_json, write_json
from draftflow.prepared_rows import EVALUATION_SET


def is_heldout(sample_id: str, fraction: float, seed: int) -> bool:
    """Stable per-sample split: depends on the id and seed only."""
    digest = hashlib.sha256(f"heldout:{seed}:{sample_id}".encode()).hexdigest()
    return int(digest[:12], 16) / 16**12 < fraction


REEXTRACT = (
    "Run `snakemake --forcerun extract_server`: shards keep the files that hold their "
    "samples' token ids and extract the others again."
)


def hidden_state_files(summary_path: Path) -> dict[str, dict]:
    """Sample id → its shard manifest entry (``path`` made absolute), from the shard
    manifests the extraction's summary (``hidden_states/manifest.json``) lists."""
    base = summary_path.parent
    files = {}
    for manifest in read_json(summary_path)["shards"]:
        for entry in read_json(base / manifest)["files"]:
            files[entry["sample_id"]] = {**entry, "path": base / entry["file"]}
    return files


def file_of(files: dict[str, dict], sample_id: str, token_ids: list[int], summary: str) -> dict:
    """The manifest entry of a row's file, refusing one the manifests lack or list
    for other token ids: the extraction predates an edit upstream of it."""
    entry = files.get(sample_id)
    if entry is None or entry["token_digest"] != token_digest(token_ids):
        found = "lists no file" if entry is None else f"lists {entry['path']} for other token ids"
        raise ValueError(f"Sample {sample_id} of the prepared dataset: {summary} {found}. {REEXTRACT}")
    return entry


def check_file(path: Path, size: int, sample_id: str) -> None:
    """Refuse a missing, resized or unparsable hidden-state file, naming it."""
    problem = (
        "is missing" if not path.exists()
        else f"has {path.stat().st_size:,} bytes, its manifest says {size:,}" if path.stat().st_size != size
        else "does not parse as safetensors" if not opens_cleanly(path)
        else None
    )  # fmt: skip
    if problem:
        raise ValueError(f"Hidden-state file {path} (sample {sample_id}) {problem}. {REEXTRACT}")


def extracted_states(summary_path: Path, samples: list[Sample]) -> dict[str, torch.Tensor]:
    """Sample id → its states in float32 as the extraction stored them (fp8:
    dequantized): the files training reads, each checked as training checks it."""
    files = hidden_state_files(summary_path)
    states = {}
    for sample in samples:
        entry = file_of(files, sample.sample_id, sample.token_ids, str(summary_path))
        check_file(entry["path"], entry["bytes"], sample.sample_id)
        states[sample.sample_id] = read_hidden_states(entry["path"])
    return states


def build_view(dataset_dir: Path, summary_path: Path, rows: list[int], view_dir: Path) -> None:
    """Save ``rows`` of the dataset to ``view_dir`` with symlinked hidden states."""
    dataset = load_from_disk(str(dataset_dir)).select(rows)
    columns = dataset.with_format(None)
    files = hidden_state_files(summary_path)
    with atomic_path(view_dir) as tmp:
        dataset.save_to_disk(str(tmp), num_shards=None if rows else 1)  # an empty one needs its one (empty) file to load
        links = tmp / "hidden_states"
        links.mkdir()
        final_links = (view_dir / "hidden_states").resolve()
        for position, (sample_id, token_ids) in enumerate(zip(columns["sample_id"], columns["input_ids"], strict=True)):
            entry = file_of(files, sample_id, token_ids, str(summary_path))
            check_file(entry["path"], entry["bytes"], sample_id)
            (links / view_file_name(position)).symlink_to(os.path.relpath(entry["path"].resolve(), final_links))


def view_identity(view_dir: Path) -> str:
    """sha256 of what training reads from a view: its dataset's files (the rows) and the
    content of each hidden-state file it links to, by the sha256 the extraction's shard
    manifests record for it (a file extracted again under its old name counts anew, and no
    hidden state is read again)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in view_dir.iterdir() if p.is_file()):
        digest.update(f"{path.name}:{file_sha256(path)}\n".encode())
    recorded: dict[Path, dict[Path, str]] = {}  # extraction summary -> file -> its sha256
    for link in sorted((view_dir / "hidden_states").iterdir()):
        file = link.resolve()
        summary = file.parents[1] / SUMMARY  # hidden_states/shard-<k>/hs_<id>.safetensors
        if summary not in recorded:
            recorded[summary] = {entry["path"].resolve(): entry["sha256"] for entry in hidden_state_files(summary).values()}
        digest.update(f"{link.name}:{recorded[summary][file]}\n".encode())
    return digest.hexdigest()


def check_view(view_dir: Path) -> int:
    """Refuse a view any of whose files holds other token ids than its row, naming
    the sample and the file; the count of rows checked. Reads only the token ids."""
    dataset = load_from_disk(str(view_dir)).with_format(None)
    for row, (sample_id, token_ids) in enumerate(zip(dataset["sample_id"], dataset["input_ids"], strict=True)):
        link = view_dir / "hidden_states" / view_file_name(row)
        held = read_token_ids(link) if link.exists() else None
        if held != token_ids:
            what = "is missing or unreadable" if held is None else (
                f"holds {len(held)} token ids that are not its row's {len(token_ids)}"
            )
            raise ValueError(
                f"Hidden-state file {link.resolve()} of sample {sample_id} (row {row} of {view_dir}) {what}: "
                f"training on it would pair one sample's hidden states with another's tokens. {REEXTRACT}"
            )
    return len(dataset)


def split_rows(dataset_dir: Path, fraction: float, seed: int) -> tuple[list[int], list[int], list[int]]:
    """(train rows, held-out rows, evaluation sets' rows) of the prepared dataset: the
    training prompts split by ``is_heldout``, the evaluation sets' rows apart."""
    columns = load_from_disk(str(dataset_dir)).with_format(None).select_columns(["sample_id", EVALUATION_SET])
    train, heldout, evaluation = [], [], []
    for i, (sample_id, evaluation_set) in enumerate(zip(columns["sample_id"], columns[EVALUATION_SET], strict=True)):
        (evaluation if evaluation_set else heldout if is_heldout(sample_id, fraction, seed) else train).append(i)
    return train, heldout, evaluation


def write_split(path: Path, train: list[int], heldout: list[int], evaluation: list[int]) -> None:
    """split.json: each view's rows of the prepared dataset, in the view's order."""
    write_json(path, {"train_rows": train, "heldout_rows": heldout, "evaluation_rows": evaluation})


def training_rows(split_path: Path) -> list[int]:
    """The training view's rows of the prepared dataset, in its order (split.json)."""
    return read_json(split_path)["train_rows"]
