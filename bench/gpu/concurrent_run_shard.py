"""The proposed ``draftflow.extraction.run_shard``: files written on threads.

``run_shard`` as it stands writes each sample synchronously in its consumer
loop (serialize, sha256, write, fsync, rename), so on a GPU a shard runs at
the speed of one writer. This is the same function with ``writers`` threads
doing ``write_sample`` (BENCHMARKS.md gives it as a diff against
draftflow/extraction.py, measured there with bench/gpu/extract_bench.py).
The calling thread still journals every record, in order, only after its
file was written, fsynced and renamed.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable

import torch

from draftflow.extraction import ExtractionSettings, Extractor, Heartbeat, Sample, ShardJournal, remove_leftovers
from draftflow.hidden_states import WrittenFile, write_sample


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

    ``writers`` threads write the files (serialize, sha256, fsync, rename) while
    the extractor computes the next ones (``writers=0``: each file is written and
    journaled before the next sample is asked for). This thread journals each record, in
    order, only after its file was written, fsynced and renamed; at most
    ``2 * writers`` samples are in flight. When a write or the extractor fails,
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

    def now(function, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(function(*args))
        except Exception as error:  # noqa: BLE001 - raised by finish()
            future.set_exception(error)
        return future

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
            submit = pool.submit if writers else now
            pending: deque[Future] = deque()
            try:
                for sample, hidden_states in extract(todo):
                    token_ids = torch.tensor(sample.token_ids, dtype=torch.int64)
                    pending.append(submit(write_sample, shard_dir, sample.index, sample.sample_id, hidden_states, token_ids))
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
