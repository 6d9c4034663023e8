"""Stage 5: hidden states per shard, resumable, with a journal, heartbeat and manifest.

Shards are the unit of resume and progress; server jobs are the unit of model
loads: each of ``plan["servers"]`` jobs loads the target once and works
through its shards (shard ``k`` belongs to server ``k % servers``).
"""

from __future__ import annotations

import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
from datasets import load_from_disk

from draftflow.extract import layout
from draftflow.extract.hidden_states import (
    Fp8States,
    read_token_ids,
    to_storage,
    write_sample,
)
from draftflow.extract.layout import (
    ExtractionSettings,
    Sample,
    WrittenFile,
    shard_samples,
)
from draftflow.io import write_json


def load_samples(dataset_dir: Path) -> list[Sample]:
    dataset = load_from_disk(str(dataset_dir)).with_format(None)
    return [
        Sample(index, sample_id, token_ids)
        for index, (sample_id, token_ids) in enumerate(
            zip(dataset["sample_id"], dataset["input_ids"], strict=True)
        )
    ]


def load_loss_masks(dataset_dir: Path, count: int) -> list[list[int]]:
    """The loss masks of the prepared dataset's first ``count`` rows (those of ``load_samples``)."""
    return load_from_disk(str(dataset_dir)).with_format(None).select(range(count))["loss_mask"]


Extractor = Callable[[list[Sample]], Iterator[tuple[Sample, torch.Tensor | Fp8States]]]
PENDING_PER_WRITER = 2  # samples handed to the writers and not yet journaled, per writer thread


class ShardJournal:
    """Append-only record of finished files; what a rerun trusts and skips.

    A file counts as done for a sample only when the journal lists it for that
    sample's id and token ids, with its size, and the file holds those token ids:
    a file written but not yet journaled when the job died, another sample's file
    under this name, or a file of the same id extracted from other tokens (an
    edit upstream) is redone. The first line holds the settings key: other
    settings start the shard over.
    """

    def __init__(self, shard_dir: Path, settings: ExtractionSettings):
        self.path = layout.journal_path(shard_dir)
        self.shard_dir = shard_dir
        self.settings_key = settings.key()

    def completed(self, samples: list[Sample]) -> dict[str, WrittenFile]:
        """The records, by sample id, of the files that hold ``samples`` as they are now."""
        vouched = layout.vouched_files(self.shard_dir, self.settings_key, samples)
        return {
            sample.sample_id: vouched[sample.sample_id]
            for sample in samples
            if sample.sample_id in vouched
            and read_token_ids(self.shard_dir / layout.file_name(sample.sample_id)) == sample.token_ids
        }

    def restart(self, kept: dict[str, WrittenFile]) -> None:
        """Rewrite the journal with the settings key and the records still valid."""
        lines = [layout.journal_line({"settings_key": self.settings_key})]
        lines += [layout.journal_line(record) for record in kept.values()]
        self.path.write_text("\n".join(lines) + "\n")

    def append(self, record: WrittenFile) -> None:
        with self.path.open("a") as stream:
            stream.write(layout.journal_line(record) + "\n")
            stream.flush()
            os.fsync(stream.fileno())


class Heartbeat:
    """A small JSON the progress check reads while the shard runs."""

    def __init__(
        self, path: Path, shard: int, samples: list[Sample], loads_model: bool, interval_s: float = 2.0
    ):
        self.path = path
        self.interval_s = interval_s
        self.state = {
            "shard": shard,
            "pid": os.getpid(),
            "loads_model": loads_model,  # False: its server job had loaded it for an earlier shard
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


def remove_leftovers(shard_dir: Path, done: dict[str, WrittenFile]) -> int:
    """Delete temp files and the files no sample of the shard claims as done now;
    the count of finished files deleted."""
    removed = 0
    for path in shard_dir.iterdir():
        sample_id = layout.file_sample_id(path.name)
        if layout.is_temp_file(path.name) or (sample_id is not None and sample_id not in done):
            path.unlink()
            removed += sample_id is not None
    return removed


def run_shard(
    samples: list[Sample],
    shard: int,
    shard_dir: Path,
    heartbeat_path: Path,
    settings: ExtractionSettings,
    open_extractor: Callable[[], AbstractContextManager[Extractor]],
    writers: int = 8,
    model_loaded: bool = False,
) -> list[WrittenFile]:
    """Extract every sample of a shard that is not already on disk.

    ``writers`` threads write the files (sha256, write, fsync, rename) while the
    extractor computes the next ones (``writers=0``: each file is written and
    journaled before the next sample is asked for). This thread journals each
    record, in order, only after its file was written, fsynced and renamed; at
    most ``PENDING_PER_WRITER * writers`` samples are in flight. When a write or the extractor fails,
    the writes under way are finished and journaled first, so the files on disk
    are exactly those the journal lists.
    """
    shard_dir.mkdir(parents=True, exist_ok=True)
    journal = ShardJournal(shard_dir, settings)
    done = journal.completed(samples)
    removed = remove_leftovers(shard_dir, done)
    journal.restart(done)
    todo = [s for s in samples if s.sample_id not in done]
    heartbeat = Heartbeat(heartbeat_path, shard, samples, loads_model=bool(todo) and not model_loaded)
    for record in done.values():
        heartbeat.add(record)
    print(
        f"shard {shard}: {len(done)} of {len(samples)} samples already on disk, {len(todo)} to extract; "
        f"{removed} file(s) that no sample claims now removed"
    )
    if not todo:
        heartbeat.set_status("done")
        return [done[s.sample_id] for s in samples]

    def finish(future: Future) -> None:
        record = future.result()  # on disk: written, fsynced, renamed (or the write's error)
        journal.append(record)
        heartbeat.add(record)
        done[record.sample_id] = record

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
                    pending.append(pool.submit(write_stored, shard_dir, sample, hidden_states, settings.storage))
                    while pending and (pending[0].done() or len(pending) >= PENDING_PER_WRITER * writers):
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
    return [done[s.sample_id] for s in samples]


class SharedExtractor:
    """One model load for all the shards of a server job: opened by the first
    shard with work left, closed when the job ends. Called like an
    ``open_extractor`` factory."""

    def __init__(self, open_extractor: Callable[[], AbstractContextManager[Extractor]]):
        self._open = open_extractor
        self._stack = ExitStack()
        self._extract: Extractor | None = None

    @property
    def loaded(self) -> bool:
        return self._extract is not None

    def __enter__(self) -> SharedExtractor:
        return self

    def __exit__(self, *exc_info) -> None:
        self._stack.close()

    @contextmanager
    def __call__(self) -> Iterator[Extractor]:
        if self._extract is None:
            self._extract = self._stack.enter_context(self._open())
        yield self._extract


def run_server(
    plan: dict,
    server: int,
    samples: list[Sample],
    output_dir: Path,
    settings: ExtractionSettings,
    open_extractor: Callable[[], AbstractContextManager[Extractor]],
    target: str,
    writers: int = 8,
) -> list[dict]:
    """Extract the shards of one server job, one after another, with one model
    load; returns their manifests, each written as its shard finishes.
    ``samples`` are the prepared dataset's rows; the plan says which go where, by
    sample id."""
    shards = [shard for shard in plan["shards"] if shard["server"] == server]
    by_id = {sample.sample_id: sample for sample in samples}
    for shard in shards:  # a manifest says "done" to the progress check: none may predate this run
        layout.shard_manifest_path(output_dir, shard["shard"]).unlink(missing_ok=True)
    manifests = []
    with SharedExtractor(open_extractor) as shared:
        for shard in shards:
            number = shard["shard"]
            records = run_shard(
                [by_id[sample_id] for sample_id, _, _ in shard["samples"]],
                number,
                layout.shard_dir(output_dir, number),
                layout.heartbeat_path(output_dir, number),
                settings,
                shared,
                writers=writers,
                model_loaded=shared.loaded,
            )
            manifest = shard_manifest(number, plan["num_shards"], records, settings, plan["hidden_size"], target)
            write_json(layout.shard_manifest_path(output_dir, number), manifest)
            manifests.append(manifest)
            print(f"shard {number}: {manifest['samples']} samples, {manifest['tokens']} tokens, {manifest['bytes'] / 1e6:.1f} MB")
    return manifests


def write_stored(shard_dir: Path, sample: Sample, hidden_states: torch.Tensor | Fp8States, storage: str) -> WrittenFile:
    """On a writer thread: quantized there for fp8, in parallel with the next samples."""
    token_ids = torch.tensor(sample.token_ids, dtype=torch.int64)
    return write_sample(shard_dir, sample.sample_id, to_storage(hidden_states, storage), token_ids)


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
        "storage": settings.storage,
        "layer_ids": list(settings.layer_ids),
        "hidden_size": hidden_size,
        "target": str(Path(target).resolve()),
        "model_identity": settings.model_identity,
        "samples": len(records),
        "tokens": sum(r.tokens for r in records),
        "bytes": sum(r.bytes for r in records),
        "files": [{"file": layout.manifest_file_entry(shard, r.sample_id), **asdict(r)} for r in records],
    }


def remove_stale_shards(output_dir: Path, num_shards: int, servers: int) -> list[str]:
    """Delete shard directories, manifests and heartbeats numbered ``num_shards``
    or more, and server manifests numbered ``servers`` or more.

    After ``extract.shards`` changes, samples move to other shards; the old
    numbers' files would otherwise sit beside the new ones unused.
    """
    removed = []
    for kind, number, path in layout.numbered_outputs(output_dir):
        if number >= (num_shards if kind == "shard" else servers):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path.name)
    return removed


def reusable_samples(output_dir: Path, samples: list[Sample], num_shards: int, settings: ExtractionSettings) -> set[str]:
    """The samples whose files their shard's next run keeps (ShardJournal.completed)."""
    return {
        sample_id
        for shard in range(num_shards)
        for sample_id in ShardJournal(layout.shard_dir(output_dir, shard), settings).completed(
            shard_samples(samples, shard, num_shards)
        )
    }


def plan_extraction(
    samples: list[Sample],
    num_shards: int,
    servers: int,
    settings: ExtractionSettings,
    hidden_size: int,
    reused: set[str] = frozenset(),
) -> dict:
    """Which sample goes to which shard and shard to which server job, the exact
    bytes each shard holds, and of them the bytes it writes: the ``reused``
    samples' files stay."""
    layer_ids = list(settings.layer_ids)
    shards = [
        {
            "shard": k,
            "server": k % servers,
            "samples": [[s.sample_id, len(s.token_ids), s.token_digest] for s in shard_samples(samples, k, num_shards)],
        }
        for k in range(num_shards)
    ]
    for shard in shards:
        sizes = {
            sample_id: layout.hidden_state_bytes(tokens, len(layer_ids), hidden_size, settings.dtype, settings.storage)
            for sample_id, tokens, _ in shard["samples"]
        }
        shard["bytes"] = sum(sizes.values())
        shard["reused"] = sum(sample_id in reused for sample_id in sizes)
        shard["bytes_to_write"] = sum(size for sample_id, size in sizes.items() if sample_id not in reused)
    return {
        "num_shards": num_shards,
        "servers": servers,
        "settings": asdict(settings),
        "layer_ids": layer_ids,
        "hidden_size": hidden_size,
        "dtype": settings.dtype,
        "storage": settings.storage,
        "samples": len(samples),
        "tokens": sum(len(s.token_ids) for s in samples),
        "bytes": sum(shard["bytes"] for shard in shards),
        "reused": sum(shard["reused"] for shard in shards),
        "bytes_to_write": sum(shard["bytes_to_write"] for shard in shards),
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
