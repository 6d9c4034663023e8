"""What extraction leaves under ``results/<run>/hidden_states/``: names, records, readers.

The only module that spells the stage's file names; standard library only, so
the progress check and the plan import it without torch::

    plan.json                      extract_plan: samples per shard, shard per server job, bytes
    shard-<k>/hs_<id>.safetensors  one per sample (id: its sample id, never its row)
    shard-<k>/.hs_<id>.safetensors.tmp  a file being written
    shard-<k>/journal.jsonl        settings key, then one WrittenFile per finished file
    shard-<k>.heartbeat.json       the shard's state while it runs
    shard-<k>.json                 the shard's manifest, written when it is done
    server-<s>.json                a server job's output: the shards it finished
    manifest.json                  the stage's summary; progress.txt, progress.json
"""

from __future__ import annotations

import hashlib
import json
from array import array
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
class ExtractionSettings:
    """Everything that determines a shard's file contents (draftflow.dependencies.extraction_settings
    builds it): the journal's first line holds its key."""

    backend: str
    layer_ids: tuple[int, ...]
    dtype: str
    model_identity: str  # draftflow.fingerprint.model_identity
    storage: str = "full"
    code: str = ""  # the extraction code's version
    builds: tuple[tuple[str, str], ...] = ()  # (package, version) of what runs it
    server_flags: tuple[str, ...] = ()  # the vllm backend's server, as its flags shape the states

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self)).encode()).hexdigest()[:16]

    @classmethod
    def from_record(cls, record: dict) -> ExtractionSettings:
        """The settings plan.json records (JSON has lists where these are tuples)."""
        tuples = {"layer_ids": tuple(record["layer_ids"]), "server_flags": tuple(record.get("server_flags", ()))}
        return cls(**{**record, **tuples, "builds": tuple(map(tuple, record.get("builds", ())))})


def shard_of(sample_id: str, num_shards: int) -> int:
    """Stable shard of a sample: independent of the other samples and their count."""
    return int(hashlib.sha256(sample_id.encode()).hexdigest()[:12], 16) % num_shards


def shard_samples(samples: list[Sample], shard: int, num_shards: int) -> list[Sample]:
    return [s for s in samples if shard_of(s.sample_id, num_shards) == shard]


@dataclass(frozen=True)
class Sample:
    index: int  # row of the prepared dataset now; nothing on disk depends on it
    sample_id: str
    token_ids: list[int]

    @property
    def token_digest(self) -> str:
        return token_digest(self.token_ids)


@dataclass(frozen=True)
class WrittenFile:
    """A journal line: one finished file, and the identity of what it holds."""

    sample_id: str
    token_digest: str  # of the token ids it was extracted from (token_digest)
    tokens: int
    bytes: int
    sha256: str


def token_digest(token_ids: list[int]) -> str:
    """A sample's identity in its shard beside its id: the same id with other tokens
    (another answer, a shorter max_seq_length) is another file's work."""
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()[:32]


def file_name(sample_id: str) -> str:
    """A sample's hidden-state file in its shard: named by sample id (ids are safe as
    file names, draftflow.prompts), so no row move can hand it to another sample."""
    return f"{FILE_PREFIX}{sample_id}{FILE_SUFFIX}"


def view_file_name(row: int) -> str:
    """A row's link in a training view, as speculators' ArrowDataset reads it."""
    return f"{FILE_PREFIX}{row}{FILE_SUFFIX}"


def file_sample_id(name: str) -> str | None:
    """The sample id of a finished file's name; None for any other name."""
    if name.startswith(FILE_PREFIX) and name.endswith(FILE_SUFFIX) and len(name) > len(FILE_PREFIX + FILE_SUFFIX):
        return name[len(FILE_PREFIX) : -len(FILE_SUFFIX)]
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


def manifest_file_entry(shard: int, sample_id: str) -> str:
    """A file as a shard manifest lists it: relative to the hidden_states folder."""
    return f"{shard_dir('', shard).name}/{file_name(sample_id)}"


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
        if file_sample_id(path.name) is not None
    ]


def heartbeats(hs_dir: Path) -> list[Path]:
    return sorted(Path(hs_dir).glob("shard-*.heartbeat.json"))


def vouched_files(shard_directory: Path, settings_key: str, samples: list[Sample]) -> dict[str, WrittenFile]:
    """The journal's records, by sample id, of ``samples`` as they are now (their token
    digest), for these settings, whose file is on disk with the recorded size."""
    key, records = read_journal(journal_path(shard_directory))
    if key != settings_key:
        return {}
    vouched = {}
    for sample in samples:
        record = records.get(sample.sample_id)
        path = shard_directory / file_name(sample.sample_id)
        if record and record.token_digest == sample.token_digest and path.exists() and path.stat().st_size == record.bytes:
            vouched[sample.sample_id] = record
    return vouched


def journal_line(record: WrittenFile | dict) -> str:
    return json.dumps(asdict(record) if isinstance(record, WrittenFile) else record)


def read_journal(path: Path) -> tuple[str | None, dict[str, WrittenFile]]:
    """(settings key, records by sample id). A line torn by a kill, or written before
    files were named by sample id, is skipped; a later record of the same sample
    replaces an earlier one."""
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
        records[record.sample_id] = record
    return key, records
