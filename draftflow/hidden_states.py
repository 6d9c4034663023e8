"""speculators' offline hidden-state files: one ``hs_{i}.safetensors`` per sample.

Each holds ``hidden_states [seq, n_layer_ids, hidden]`` (the last slot is the
final layer's output before the norm) and ``token_ids [seq]``.
"""

from __future__ import annotations

import errno
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TOKEN_ID_BYTES = 8  # int64
HEADER_BYTES_MAX = 256  # safetensors' JSON header for these two tensors


def file_name(index: int) -> str:
    return f"hs_{index}.safetensors"


def expected_bytes(tokens: int, num_layer_ids: int, hidden_size: int, dtype: str) -> int:
    """Exact data bytes of one file, plus the header's upper bound."""
    data = tokens * (num_layer_ids * hidden_size * DTYPE_BYTES[dtype] + TOKEN_ID_BYTES)
    return data + HEADER_BYTES_MAX


class DiskFullError(OSError):
    pass


@dataclass(frozen=True)
class WrittenFile:
    index: int
    sample_id: str
    tokens: int
    bytes: int
    sha256: str


def write_sample(
    directory: Path, index: int, sample_id: str, hidden_states: torch.Tensor, token_ids: torch.Tensor
) -> WrittenFile:
    """Write one sample atomically (temp file, fsync, rename); return its record."""
    payload = save(
        {"hidden_states": hidden_states.contiguous(), "token_ids": token_ids.to(torch.int64)}
    )
    path = directory / file_name(index)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("wb") as stream:
            stream.write(payload)
            stream.flush()
            os.fsync(stream.fileno())
    except OSError as error:
        tmp.unlink(missing_ok=True)
        if error.errno == errno.ENOSPC:
            raise DiskFullError(
                f"Disk full while writing {path} ({len(payload):,} bytes, sample {sample_id}). "
                "The files written before it are intact and journaled: free space (the "
                "progress check shows how much the rest needs) and rerun to resume."
            ) from error
        raise
    os.replace(tmp, path)
    return WrittenFile(
        index=index,
        sample_id=sample_id,
        tokens=int(token_ids.numel()),
        bytes=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
    )


def opens_cleanly(path: Path) -> bool:
    """True when safetensors can parse the header and the sizes add up."""
    try:
        with safe_open(str(path), framework="pt"):
            return True
    except Exception:  # noqa: BLE001 - any parse failure means "redo this file"
        return False
