"""Identities of a target model folder: what its outputs depend on.

Three parts, so that each stage keys only what changes its bytes
(``draftflow.dependencies``):

- the **model**: ``config.json``, the weight index, and each weight file by
  name and the sha256 of all its bytes;
- the **tokenizer**: its files and the chat template transformers 5 saves
  beside them (``chat_template.jinja``);
- for a snapshot of the hub cache, its id and commit (in both); the commit
  names its weights' bytes (the cache's blobs are never written over), so a
  snapshot's weight files are not read.

A weight file is read whole once per change: its hash is kept in draftflow's
cache (``vllm_registry.cache_dir()``, ``weight-sha256/``) under its device,
inode, size and mtime, so an unchanged target costs a ``stat`` per file, and
a write (which moves the mtime) or another file (another inode) is hashed
again. Any edit is seen, one tensor or one byte: sampling the bytes missed
edits of part of a file (issue 60). Paths and mtimes are left out of the
identities: a copied or moved folder is the same target, after one hash.

Standard library only at import (tqdm when a large target is hashed):
Snakemake's parse reads it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from pathlib import Path

from draftflow.io import write_text
from draftflow.target_source import snapshot_identity
from draftflow.vllm_registry import cache_dir

MODEL_FILES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
WEIGHT_DIGESTS = "weight-sha256"  # the cache's folder of weight files' hashes, one small file each
# Weight bytes not yet hashed above which hashing shows a bar and the plan says it reads them
# (half a second at 2 GB/s: less passes unremarked).
LARGE_HASH_BYTES = 1 << 30
# A file written this shortly before it is hashed is not cached: a second write within the
# file system's timestamp tick (coarse on some) would leave its stat as it was (git's "racy" files).
RACY_WRITE_NS = 2 * 10**9


def file_sha256(path: str | Path, chunk: int = 1 << 20, progress=None) -> str:
    """sha256 of ``path``'s bytes; ``progress`` (a tqdm bar) counts them as they are read."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as stream:
        while block := stream.read(chunk):
            digest.update(block)
            if progress is not None:
                progress.update(len(block))
    return digest.hexdigest()


def files_digest(folder: Path, names: tuple[str, ...], digest) -> None:
    for name in names:
        if (path := folder / name).exists():
            digest.update(f"{name}:{file_sha256(path)}\n".encode())


def weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def cache_entry(stat: os.stat_result) -> Path:
    """Where a weight file's hash is kept: named by what the file system says of it, so
    that a write (a new mtime or size) or another file (a new inode) finds no entry."""
    return cache_dir() / WEIGHT_DIGESTS / f"{stat.st_dev}-{stat.st_ino}-{stat.st_size}-{stat.st_mtime_ns}"


def unhashed_bytes(files: list[Path]) -> int:
    """Bytes of ``files`` not hashed since they last changed."""
    stats = [path.stat() for path in files]
    return sum(stat.st_size for stat in stats if not cache_entry(stat).exists())


def uncached_weight_bytes(model_dir: str | Path) -> int:
    """Bytes the next identity of ``model_dir`` reads: its weight files not hashed since
    they last changed (none in a hub snapshot)."""
    folder = Path(model_dir)
    return 0 if snapshot_identity(folder) else unhashed_bytes(weight_files(folder))


def weight_file_digest(path: Path, progress=None) -> str:
    """sha256 of all of ``path``'s bytes, from the cache while the file is unchanged."""
    # Stat before reading: a write while the file is read moves its mtime, so the next call hashes again.
    now, stat = time.time_ns(), path.stat()
    entry = cache_entry(stat)
    if entry.exists():
        return entry.read_text()
    digest = file_sha256(path, progress=progress)
    if now - stat.st_mtime_ns > RACY_WRITE_NS:
        write_text(entry, digest)  # atomic: two processes hashing one file write the same entry
    return digest


def hashing_progress(total: int):
    """A bar on stderr while ``total`` weight bytes are hashed, where that takes a while."""
    if total <= LARGE_HASH_BYTES:
        return contextlib.nullcontext()
    from tqdm import tqdm  # here: only a large hash draws, and the parse imports this module

    return tqdm(total=total, unit="B", unit_scale=True, desc="hashing the target's weights (once; cached after)")


def weights_digest(folder: Path, digest) -> None:
    files = weight_files(folder)
    with hashing_progress(unhashed_bytes(files)) as progress:
        for path in files:
            digest.update(f"{path.name}:{weight_file_digest(path, progress)}\n".encode())


def identity(model_dir: str | Path, files: tuple[str, ...], weights: bool) -> str:
    """Digest of a target's hub commit, ``files`` and, with ``weights``, its weight files."""
    folder = Path(model_dir)
    digest = hashlib.sha256(f"{files}\n".encode())
    if hub := snapshot_identity(folder):
        digest.update(f"hub:{hub}\n".encode())
    files_digest(folder, files, digest)
    if weights and not hub:  # a snapshot's commit stands for its weights
        weights_digest(folder, digest)
    return digest.hexdigest()


def model_identity(model_dir: str | Path) -> str:
    """What the target computes: its config, its weights (hashed whole, above) and its hub commit."""
    return identity(model_dir, MODEL_FILES, weights=True)


def tokenizer_identity(model_dir: str | Path) -> str:
    """How the target's text becomes tokens: its tokenizer files and chat template."""
    return identity(model_dir, TOKENIZER_FILES, weights=False)


def target_fingerprint(model_dir: str | Path) -> str:
    """The whole target: model, tokenizer and ``generation_config.json`` (the sampling
    defaults vLLM serves with)."""
    folder = Path(model_dir)
    digest = hashlib.sha256(f"{model_identity(folder)}\n{tokenizer_identity(folder)}\n".encode())
    files_digest(folder, ("generation_config.json",), digest)
    return digest.hexdigest()
