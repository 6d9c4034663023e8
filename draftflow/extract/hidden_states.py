"""speculators' offline hidden-state files: one ``.safetensors`` per sample.

Each holds ``hidden_states [seq, n_layer_ids, hidden]`` (the last slot is the
final layer's output before the norm) and ``token_ids [seq]``. In ``fp8``
storage (``extract.storage``) ``hidden_states`` is float8_e4m3fn and
``hidden_states_scales [seq, 1, 1]`` (float32) holds one scale per token: the
format of hs_connectors' ``FP8HiddenStatesConnector``, which speculators'
``FP8Transfer`` dequantizes on read.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from hs_connectors.fp8_utils import (
    SCALES_KEY,
    dequantize_fp8_tensor,
    quantize_tensor_to_fp8,
)
from safetensors import safe_open
from safetensors.torch import load_file

from draftflow.extract.layout import WrittenFile, file_name, temp_file, token_digest

SAFETENSORS_DTYPES = {
    torch.int64: "I64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3",
}  # fmt: skip
STORAGES = ("full", "fp8")


class DiskFullError(OSError):
    pass


@dataclass(frozen=True)
class Fp8States:
    """Hidden states as fp8 stores them: float8_e4m3fn values and one float32 scale per token."""

    values: torch.Tensor
    scales: torch.Tensor

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8_tensor(self.values, self.scales, dtype)


def to_storage(hidden_states: torch.Tensor | Fp8States, storage: str) -> torch.Tensor | Fp8States:
    """The states as ``storage`` keeps them (a vLLM fp8 connector quantized them already)."""
    if storage == "fp8":
        return hidden_states if isinstance(hidden_states, Fp8States) else Fp8States(*quantize_tensor_to_fp8(hidden_states))
    if isinstance(hidden_states, Fp8States):
        raise ValueError("fp8 hidden states reached a shard whose extract.storage is full")
    return hidden_states


def safetensors_parts(hidden_states: torch.Tensor | Fp8States, token_ids: torch.Tensor) -> list[memoryview]:
    """The bytes ``safetensors.torch.save`` returns for these tensors, as buffers over
    the tensors' own memory: no copy of the payload is made.

    safetensors orders the tensors by alignment, largest first (int64 token ids,
    then float32 scales, then the states), and pads its JSON header with spaces to
    a multiple of 8 bytes.
    """
    tensors = {"token_ids": token_ids.to(torch.int64).contiguous().reshape(-1)}
    if isinstance(hidden_states, Fp8States):
        tensors[SCALES_KEY] = hidden_states.scales.to(torch.float32).contiguous()
        tensors["hidden_states"] = hidden_states.values.contiguous()
    else:
        tensors["hidden_states"] = hidden_states.contiguous()
    header_entries, offset = {}, 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header_entries[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                                "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    header = json.dumps(header_entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    raw = lambda t: memoryview(t.reshape(-1).view(torch.uint8).numpy())  # noqa: E731
    return [memoryview(struct.pack("<Q", len(header)) + header), *(raw(t) for t in tensors.values())]


def write_sample(
    directory: Path, sample_id: str, hidden_states: torch.Tensor | Fp8States, token_ids: torch.Tensor
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
    path = directory / file_name(sample_id)
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
        sample_id=sample_id,
        token_digest=token_digest(token_ids.tolist()),
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


def read_token_ids(path: Path) -> list[int] | None:
    """The token ids a file holds (its smallest tensor, read alone); None when it
    does not parse."""
    try:
        with safe_open(str(path), framework="pt") as stream:
            return stream.get_tensor("token_ids").tolist()
    except Exception:  # noqa: BLE001 - any parse failure means "not this sample's file"
        return None


def payload_states(payload: dict[str, torch.Tensor]) -> torch.Tensor | Fp8States:
    """A file's (or a vLLM connector's) hidden states as stored: fp8 when it has scales."""
    if SCALES_KEY in payload:
        return Fp8States(payload["hidden_states"], payload[SCALES_KEY])
    return payload["hidden_states"]


def full_precision(states: torch.Tensor | Fp8States, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return states.dequantized(dtype) if isinstance(states, Fp8States) else states.to(dtype)


def read_hidden_states(path: Path, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A file's hidden states in ``dtype``, dequantized when stored as fp8."""
    return full_precision(payload_states(load_file(path)), dtype)
