"""Stage 5: hidden states per shard, resumable, with a journal, heartbeat and manifest."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from datasets import load_from_disk

from draftflow.file_names import file_name
from draftflow.hidden_states import WrittenFile, expected_bytes, write_sample
from draftflow.io import write_json


@dataclass(frozen=True)
class Sample:
    index: int  # row of the prepared dataset; the file is hs_{index}.safetensors
    sample_id: str
    token_ids: list[int]


@dataclass(frozen=True)
class ExtractionSettings:
    """Everything that determines a shard's file contents."""

    backend: str
    layer_ids: tuple[int, ...]
    dtype: str
    target_fingerprint: str

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self)).encode()).hexdigest()[:16]


def shard_of(sample_id: str, num_shards: int) -> int:
    """Stable shard of a sample: independent of the other samples and their count."""
    return int(hashlib.sha256(sample_id.encode()).hexdigest()[:12], 16) % num_shards


def load_samples(dataset_dir: Path) -> list[Sample]:
    dataset = load_from_disk(str(dataset_dir)).with_format(None)
    return [
        Sample(index, sample_id, token_ids)
        for index, (sample_id, token_ids) in enumerate(
            zip(dataset["sample_id"], dataset["input_ids"], strict=True)
        )
    ]


def shard_samples(samples: list[Sample], shard: int, num_shards: int) -> list[Sample]:
    return [s for s in samples if shard_of(s.sample_id, num_shards) == shard]


Extractor = Callable[[list[Sample]], Iterator[tuple[Sample, torch.Tensor]]]


class ShardJournal:
    """Append-only record of finished files; what a rerun trusts and skips.

    A file counts as done only when the journal lists it with its size, so a
    file written but not yet journaled when the job died is simply redone.
    The first line holds the settings key: other settings start the shard over.
    """

    def __init__(self, shard_dir: Path, settings: ExtractionSettings):
        self.path = shard_dir / "journal.jsonl"
        self.shard_dir = shard_dir
        self.settings_key = settings.key()

    def completed(self) -> dict[int, WrittenFile]:
        if not self.path.exists():
            return {}
        lines = self.path.read_text().splitlines()
        if not lines or json.loads(lines[0]).get("settings_key") != self.settings_key:
            return {}
        done = {}
        for line in lines[1:]:
            try:
                record = WrittenFile(**json.loads(line))
            except (json.JSONDecodeError, TypeError):
                continue  # a line torn by a kill
            path = self.shard_dir / file_name(record.index)
            if path.exists() and path.stat().st_size == record.bytes:
                done[record.index] = record
        return done

    def restart(self, kept: dict[int, WrittenFile]) -> None:
        """Rewrite the journal with the settings key and the records still valid."""
        lines = [json.dumps({"settings_key": self.settings_key})]
        lines += [json.dumps(asdict(record)) for record in kept.values()]
        self.path.write_text("\n".join(lines) + "\n")

    def append(self, record: WrittenFile) -> None:
        with self.path.open("a") as stream:
            stream.write(json.dumps(asdict(record)) + "\n")
            stream.flush()
            os.fsync(stream.fileno())


class Heartbeat:
    """A small JSON the progress check reads while the shard runs."""

    def __init__(self, path: Path, shard: int, samples: list[Sample], interval_s: float = 2.0):
        self.path = path
        self.interval_s = interval_s
        self.state = {
            "shard": shard,
            "pid": os.getpid(),
            "status": "loading",
            "samples_total": len(samples),
            "tokens_total": sum(len(s.token_ids) for s in samples),
            "samples_done": 0,
            "tokens_done": 0,
            "bytes_done": 0,
            "started_at": time.time(),
            "model_ready_at": None,
            "updated_at": None,
        }
        self._last_write = 0.0

    def add(self, record: WrittenFile) -> None:
        self.state["samples_done"] += 1
        self.state["tokens_done"] += record.tokens
        self.state["bytes_done"] += record.bytes
        if time.monotonic() - self._last_write >= self.interval_s:
            self.write()

    def set_status(self, status: str) -> None:
        self.state["status"] = status
        if status == "running":
            self.state["model_ready_at"] = time.time()
        self.write()

    def write(self) -> None:
        self.state["updated_at"] = time.time()
        write_json(self.path, self.state)
        self._last_write = time.monotonic()


def remove_leftovers(shard_dir: Path, done: dict[int, WrittenFile]) -> None:
    """Delete temp files and files the journal does not vouch for."""
    for path in shard_dir.glob(".hs_*.tmp"):
        path.unlink()
    for path in shard_dir.glob("hs_*.safetensors"):
        if int(path.stem.removeprefix("hs_")) not in done:
            path.unlink()


def run_shard(
    samples: list[Sample],
    shard: int,
    shard_dir: Path,
    heartbeat_path: Path,
    settings: ExtractionSettings,
    open_extractor: Callable[[], AbstractContextManager[Extractor]],
    writers: int = 8,
) -> list[WrittenFile]:
    """Extract every sample of a shard that is not already on disk.

    ``writers`` threads write the files (sha256, write, fsync, rename) while the
    extractor computes the next ones (``writers=0``: each file is written and
    journaled before the next sample is asked for). This thread journals each
    record, in order, only after its file was written, fsynced and renamed; at
    most ``2 * writers`` samples are in flight. When a write or the extractor fails,
    the writes under way are finished and journaled first, so the files on disk
    are exactly those the journal lists.
    """
    shard_dir.mkdir(parents=True, exist_ok=True)
    journal = ShardJournal(shard_dir, settings)
    done = journal.completed()
    remove_leftovers(shard_dir, done)
    journal.restart(done)
    heartbeat = Heartbeat(heartbeat_path, shard, samples)
    for record in done.values():
        heartbeat.add(record)
    todo = [s for s in samples if s.index not in done]
    print(f"shard {shard}: {len(done)} of {len(samples)} samples already on disk")

    def finish(future: Future) -> None:
        record = future.result()  # on disk: written, fsynced, renamed (or the write's error)
        journal.append(record)
        heartbeat.add(record)
        done[record.index] = record

    def drain(pending: deque) -> BaseException | None:
        failure = None
        while pending:
            try:
                finish(pending.popleft())
            except Exception as error:  # noqa: BLE001 - the first one is raised by the caller
                failure = failure or error
        return failure

    try:
        heartbeat.set_status("loading")
        with open_extractor() as extract, ThreadPoolExecutor(max(writers, 1), thread_name_prefix="write") as pool:
            heartbeat.set_status("running")
            pending: deque[Future] = deque()
            try:
                for sample, hidden_states in extract(todo):
                    token_ids = torch.tensor(sample.token_ids, dtype=torch.int64)
                    pending.append(pool.submit(write_sample, shard_dir, sample.index, sample.sample_id, hidden_states, token_ids))
                    while pending and (pending[0].done() or len(pending) >= 2 * writers):
                        finish(pending.popleft())
            except BaseException:
                drain(pending)
                raise
            if failure := drain(pending):
                raise failure
    except BaseException:
        heartbeat.set_status("failed")
        raise
    heartbeat.set_status("done")
    return [done[s.index] for s in samples]


def shard_manifest(
    shard: int,
    num_shards: int,
    records: list[WrittenFile],
    settings: ExtractionSettings,
    hidden_size: int,
    target: str,
) -> dict:
    return {
        "shard": shard,
        "num_shards": num_shards,
        "backend": settings.backend,
        "dtype": settings.dtype,
        "layer_ids": list(settings.layer_ids),
        "hidden_size": hidden_size,
        "target": str(Path(target).resolve()),
        "target_fingerprint": settings.target_fingerprint,
        "samples": len(records),
        "tokens": sum(r.tokens for r in records),
        "bytes": sum(r.bytes for r in records),
        "files": [{"file": f"shard-{shard}/{file_name(r.index)}", **asdict(r)} for r in records],
    }


def remove_stale_shards(output_dir: Path, num_shards: int) -> list[str]:
    """Delete shard directories and manifests numbered ``num_shards`` or more.

    After ``extract.shards`` changes, samples move to other shards; the old
    numbers' files would otherwise sit beside the new ones unused.
    """
    removed = []
    for path in sorted(output_dir.glob("shard-*")):
        number = path.name.removeprefix("shard-").split(".")[0]
        if number.isdigit() and int(number) >= num_shards:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path.name)
    return removed


def plan_extraction(
    samples: list[Sample],
    num_shards: int,
    layer_ids: list[int],
    hidden_size: int,
    dtype: str,
) -> dict:
    """Which sample goes to which shard, and the exact bytes each shard writes."""
    shards = [
        {"shard": k, "samples": [[s.index, len(s.token_ids)] for s in shard_samples(samples, k, num_shards)]}
        for k in range(num_shards)
    ]
    for shard in shards:
        shard["bytes"] = sum(
            expected_bytes(tokens, len(layer_ids), hidden_size, dtype) for _, tokens in shard["samples"]
        )
    return {
        "num_shards": num_shards,
        "layer_ids": layer_ids,
        "hidden_size": hidden_size,
        "dtype": dtype,
        "samples": len(samples),
        "tokens": sum(len(s.token_ids) for s in samples),
        "bytes": sum(shard["bytes"] for shard in shards),
        "shards": shards,
    }


def check_free_space(directory: Path, needed_bytes: int, margin: float) -> dict:
    """Fail before any model loads when the output's disk cannot hold the stage."""
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free
    required = int(needed_bytes * (1 + margin))
    if free < required:
        raise OSError(
            f"Not enough disk for hidden states in {directory}: the stage writes "
            f"{needed_bytes / 1e9:.2f} GB (+{margin:.0%} margin = {required / 1e9:.2f} GB), "
            f"but only {free / 1e9:.2f} GB are free. Free space, point the run at a "
            "larger disk, or lower data.num_samples / prepare.max_seq_length."
        )
    return {"free_bytes": free, "required_bytes": required}
