"""What extraction leaves under ``results/<run>/hidden_states/``: names, records, readers.

The only module that spells the stage's file names; standard library only, so
the progress check and the plan import it without torch::

    plan.json                      extract_plan: samples per shard, shard per server job, bytes
    shard-<k>/hs_<i>.safetensors   one per sample (i: the prepared dataset's row)
    shard-<k>/.hs_<i>.safetensors.tmp   a file being written
    shard-<k>/journal.jsonl        settings key, then one WrittenFile per finished file
    shard-<k>.heartbeat.json       the shard's state while it runs
    shard-<k>.json                 the shard's manifest, written when it is done
    server-<s>.json                a server job's output: the shards it finished
    manifest.json                  the stage's summary; progress.txt, progress.json
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

PLAN = "plan.json"
SUMMARY = "manifest.json"
PROGRESS_TABLE = "progress.txt"
PROGRESS_JSON = "progress.json"
FILE_PREFIX, FILE_SUFFIX = "hs_", ".safetensors"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TOKEN_ID_BYTES = 8  # int64
FP8_VALUE_BYTES, FP8_SCALE_BYTES = 1, 4  # float8_e4m3fn per value, float32 scale per token
HEADER_BYTES_MAX = 320  # safetensors' JSON header for the two (fp8: three) tensors


@dataclass(frozen=True)
class Sample:
    index: int  # row of the prepared dataset; the file is hs_{index}.safetensors
    sample_id: str
    token_ids: list[int]


@dataclass(frozen=True)
class WrittenFile:
    """A journal line: one finished file."""

    index: int
    sample_id: str
    tokens: int
    bytes: int
    sha256: str


def file_name(index: int) -> str:
    """A sample's hidden-state file, as speculators names them."""
    return f"{FILE_PREFIX}{index}{FILE_SUFFIX}"


def file_index(name: str) -> int | None:
    """The row of a finished file's name; None for any other name."""
    if name.startswith(FILE_PREFIX) and name.endswith(FILE_SUFFIX):
        number = name[len(FILE_PREFIX) : -len(FILE_SUFFIX)]
        return int(number) if number.isdigit() else None
    return None


def is_temp_file(name: str) -> bool:
    return name.startswith(f".{FILE_PREFIX}") and name.endswith(".tmp")


def temp_file(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def hidden_state_bytes(tokens: int, num_layer_ids: int, hidden_size: int, dtype: str, storage: str) -> int:
    """One file's exact data bytes plus the header's upper bound: the size of a run's
    hidden states in either ``extract.storage`` (``dtype`` is the model's, for ``full``)."""
    values = num_layer_ids * hidden_size
    per_token = values * FP8_VALUE_BYTES + FP8_SCALE_BYTES if storage == "fp8" else values * DTYPE_BYTES[dtype]
    return tokens * (per_token + TOKEN_ID_BYTES) + HEADER_BYTES_MAX


def shard_dir(hs_dir: Path | str, shard: int | str) -> Path:
    return Path(hs_dir) / f"shard-{shard}"


def journal_path(shard_directory: Path) -> Path:
    return shard_directory / "journal.jsonl"


def heartbeat_path(hs_dir: Path | str, shard: int | str) -> Path:
    return Path(hs_dir) / f"shard-{shard}.heartbeat.json"


def shard_manifest_path(hs_dir: Path | str, shard: int | str) -> Path:
    return Path(hs_dir) / f"shard-{shard}.json"


def server_manifest_path(hs_dir: Path | str, server: int | str) -> Path:
    """``server`` may be a Snakemake wildcard (``"{server}"``)."""
    return Path(hs_dir) / f"server-{server}.json"


def manifest_file_entry(shard: int, index: int) -> str:
    """A file as a shard manifest lists it: relative to the hidden_states folder."""
    return f"{shard_dir('', shard).name}/{file_name(index)}"


def numbered_outputs(hs_dir: Path) -> list[tuple[str, int, Path]]:
    """("shard" or "server", number, path) of every numbered entry of ``hs_dir``."""
    entries = []
    for kind in ("shard", "server"):
        for path in sorted(hs_dir.glob(f"{kind}-*")):
            number = path.name.removeprefix(f"{kind}-").split(".")[0]
            if number.isdigit():
                entries.append((kind, int(number), path))
    return entries


def hidden_state_files(hs_dir: Path) -> list[Path]:
    """Every finished hidden-state file of every shard."""
    return [
        path
        for kind, _, folder in numbered_outputs(hs_dir)
        if kind == "shard" and folder.is_dir()
        for path in folder.iterdir()
        if file_index(path.name) is not None
    ]


def heartbeats(hs_dir: Path) -> list[Path]:
    return sorted(Path(hs_dir).glob("shard-*.heartbeat.json"))


def journal_line(record: WrittenFile | dict) -> str:
    return json.dumps(asdict(record) if isinstance(record, WrittenFile) else record)


def read_journal(path: Path) -> tuple[str | None, dict[int, WrittenFile]]:
    """(settings key, records by row). A line torn by a kill is skipped; a later
    record of the same row replaces an earlier one."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return None, {}
    if not lines:
        return None, {}
    try:
        key = json.loads(lines[0]).get("settings_key")
    except json.JSONDecodeError:
        return None, {}
    records = {}
    for line in lines[1:]:
        try:
            record = WrittenFile(**json.loads(line))
        except (json.JSONDecodeError, TypeError):
            continue
        records[record.index] = record
    return key, records
