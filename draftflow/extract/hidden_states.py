"""speculators' offline hidden-state files: one ``hs_{i}.safetensors`` per sample.

Each holds ``hidden_states [seq, n_layer_ids, hidden]`` (the last slot is the
final layer's output before the norm) and ``token_ids [seq]``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from draftflow.extract.layout import WrittenFile, file_name, temp_file

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class DiskFullError(OSError):
    pass


def safetensors_parts(hidden_states: torch.Tensor, token_ids: torch.Tensor) -> list[memoryview]:
    """The bytes ``safetensors.torch.save`` returns for these two tensors, as buffers over
    the tensors' own memory: no copy of the payload is made.

    safetensors puts the 8-byte-aligned int64 token ids first, then the hidden states,
    and pads its JSON header with spaces to a multiple of 8 bytes.
    """
    token_ids = token_ids.to(torch.int64).contiguous().reshape(-1)
    hidden_states = hidden_states.contiguous()
    ids_bytes = token_ids.numel() * 8
    states_bytes = hidden_states.numel() * hidden_states.element_size()
    header = json.dumps(
        {
            "token_ids": {"dtype": "I64", "shape": [token_ids.numel()], "data_offsets": [0, ids_bytes]},
            "hidden_states": {
                "dtype": SAFETENSORS_DTYPES[hidden_states.dtype],
                "shape": list(hidden_states.shape),
                "data_offsets": [ids_bytes, ids_bytes + states_bytes],
            },
        },
        separators=(",", ":"),
    ).encode()
    header += b" " * (-len(header) % 8)
    raw = lambda t: memoryview(t.reshape(-1).view(torch.uint8).numpy())  # noqa: E731
    return [memoryview(struct.pack("<Q", len(header)) + header), raw(token_ids), raw(hidden_states)]


def write_sample(
    directory: Path, index: int, sample_id: str, hidden_states: torch.Tensor, token_ids: torch.Tensor
) -> WrittenFile:
    """Write one sample atomically (temp file, fsync, rename); return its record.

    The file is written and hashed straight from the tensors' memory (the bytes
    are those of ``safetensors.torch.save``); hashing and writing release the
    GIL, so writes on several threads run in parallel.
    """
    parts = safetensors_parts(hidden_states, token_ids)
    size = sum(part.nbytes for part in parts)
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    path = directory / file_name(index)
    tmp = temp_file(path)
    try:
        with tmp.open("wb") as stream:
            for part in parts:
                stream.write(part)
            stream.flush()
            os.fsync(stream.fileno())
    except OSError as error:
        tmp.unlink(missing_ok=True)
        if error.errno == errno.ENOSPC:
            raise DiskFullError(
                f"Disk full while writing {path} ({size:,} bytes, sample {sample_id}). "
                "The files written before it are intact and journaled: free space (the "
                "progress check shows how much the rest needs) and rerun to resume."
            ) from error
        raise
    os.replace(tmp, path)
    return WrittenFile(
        index=index,
        sample_id=sample_id,
        tokens=int(token_ids.numel()),
        bytes=size,
        sha256=digest.hexdigest(),
    )


def opens_cleanly(path: Path) -> bool:
    """True when safetensors can parse the header and the sizes add up."""
    try:
        with safe_open(str(path), framework="pt"):
            return True
    except Exception:  # noqa: BLE001 - any parse failure means "redo this file"
        return False
