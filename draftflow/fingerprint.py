"""Identities of a target model folder: what its outputs depend on, cheap to compute.

Three parts, so that each stage keys only what changes its bytes
(``draftflow.dependencies``):

- the **model**: ``config.json``, the weight index, and each weight file by
  name, size, safetensors header and sampled bytes of its tensor data (no full
  hash: a 2 TB checkpoint reads in seconds, not hours);
- the **tokenizer**: its files and the chat template transformers 5 saves
  beside them (``chat_template.jinja``);
- for a snapshot of the hub cache, its id and commit (in both).

Paths and mtimes are left out: a copied or moved folder is the same target.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

from draftflow.target_source import snapshot_identity

MODEL_FILES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
# Bytes read from each weight file's tensor data, at evenly spread offsets: a fine-tuned
# checkpoint saved over the old one changes (almost) every weight, so every sample.
WEIGHT_SAMPLES, WEIGHT_SAMPLE_BYTES = 8, 4096


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as stream:
        while block := stream.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def files_digest(folder: Path, names: tuple[str, ...], digest) -> None:
    for name in names:
        if (path := folder / name).exists():
            digest.update(f"{name}:{file_sha256(path)}\n".encode())


def weight_file_digest(path: Path) -> str:
    """Name-free digest of a weight file: its size, its safetensors header (every tensor's
    name, dtype, shape and offsets) and WEIGHT_SAMPLES spread samples of its data."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    digest.update(f"{size}\n".encode())
    with path.open("rb") as stream:
        data_start = 0
        if path.suffix == ".safetensors" and size >= 8:
            (header_length,) = struct.unpack("<Q", stream.read(8))
            data_start = min(8 + header_length, size)
            digest.update(stream.read(data_start - 8))
        span = max(size - data_start - WEIGHT_SAMPLE_BYTES, 0)
        for k in range(WEIGHT_SAMPLES):
            stream.seek(data_start + span * k // max(WEIGHT_SAMPLES - 1, 1))
            digest.update(stream.read(WEIGHT_SAMPLE_BYTES))
    return digest.hexdigest()


def identity(model_dir: str | Path, files: tuple[str, ...], weights: bool) -> str:
    """Digest of a target's hub commit, ``files`` and, with ``weights``, its weight files."""
    folder = Path(model_dir)
    digest = hashlib.sha256(f"{files}\n".encode())
    if hub := snapshot_identity(folder):
        digest.update(f"hub:{hub}\n".encode())
    files_digest(folder, files, digest)
    for path in sorted(p for p in folder.iterdir() if weights and p.suffix in WEIGHT_SUFFIXES and p.is_file()):
        digest.update(f"{path.name}:{weight_file_digest(path)}\n".encode())
    return digest.hexdigest()


def model_identity(model_dir: str | Path) -> str:
    """What the target computes: its config, its weights (sampled, above) and its hub commit."""
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
