"""Content hashes that identify a target model and its tokenizer."""

from __future__ import annotations

import hashlib
from pathlib import Path

from draftflow.target_source import snapshot_identity

IDENTITY_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as stream:
        while block := stream.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def target_fingerprint(model_dir: str | Path) -> str:
    """Hash of the target's config and tokenizer files (not its weights) and, for a
    snapshot of the hub cache, its id and commit: a new commit that changes only
    the weights changes the fingerprint too."""
    digest = hashlib.sha256()
    if identity := snapshot_identity(model_dir):
        digest.update(f"hub:{identity}\n".encode())
    for name in IDENTITY_FILES:
        path = Path(model_dir) / name
        if path.exists():
            digest.update(f"{name}:{file_sha256(path)}\n".encode())
    return digest.hexdigest()
