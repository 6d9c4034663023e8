"""What the progress check reads: only what the extraction leaves under
``results/<run>/hidden_states/``:

- ``plan.json``: every sample's token count (from the prepared dataset), per
  shard, and the server job of each shard;
- ``shard-<k>/journal.jsonl``: finished files; one counts as done only when
  the journal lists it and its size on disk matches (what a rerun trusts);
- the files: sizes, temp files in flight, and mtimes, which say when each
  file was finished, so the recent rate needs no history of its own;
- ``shard-<k>.heartbeat.json``: state, pid, whether the shard loads the model
  (only the first of a server job's shards does), when loading began and when the
  model became ready (rates leave model loading out);
- ``shard-<k>.json``: the manifest; a shard with one is done.

Standard library (and PyYAML for ``--configfile``) only, so a check is fast:
draftflow.extract.hidden_states is not imported because it imports torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from draftflow import run_folder
from draftflow.extract import layout

ACTIVE = ("loading", "running")  # shard states


@dataclass(frozen=True)
class Options:
    window_s: float = 300.0
    stall_after_s: float = 600.0
    free_bytes: int | None = None  # instead of the measured free space
    reserve_bytes: int | None = None  # what the later stages need, instead of --configfile's estimate
    configs: tuple[Path, ...] = ()  # the run's config files, merged as Snakemake merges them
    check_pids: bool = True


@dataclass(frozen=True)
class DoneFile:
    sample_id: str
    tokens: int
    bytes: int
    finished_at: float  # the file's mtime


@dataclass
class ShardScan:
    """What one shard left on disk."""

    shard: int
    server: int  # the extraction job that holds it (plan.json)
    planned: dict[str, int]  # sample id -> tokens
    done: list[DoneFile]
    in_flight_bytes: int
    unjournaled_files: int
    heartbeat: dict | None
    has_manifest: bool


class ProgressError(Exception):
    """A file the check needs is missing or not what it should be: one line, exit 1."""


PLAN_KEYS = ("shards", "samples", "tokens", "bytes", "layer_ids")


def hidden_states_dir(path: Path) -> Path:
    """The extraction's folder, given ``results/<run>`` or the folder itself."""
    for folder in (run_folder.hidden_states_dir(path), path):
        if (folder / layout.PLAN).is_file():
            return folder
    raise ProgressError(
        f"{run_folder.hidden_states_dir(path) / layout.PLAN}: no extraction plan. Give results/<run> or its "
        f"{run_folder.HIDDEN_STATES}/ folder; the extraction's extract_plan job writes the plan as it starts."
    )


def read_extraction_plan(hs_dir: Path) -> dict:
    path = hs_dir / layout.PLAN
    try:
        plan = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ProgressError(f"{path}: not readable ({error}); rerun the extract_plan job, which writes it") from error
    if missing := [key for key in PLAN_KEYS if not isinstance(plan, dict) or key not in plan]:
        raise ProgressError(
            f"{path}: not an extraction plan (no {', '.join(missing)}); rerun the extract_plan job, which writes it"
        )
    return plan


def read_json_or_none(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def directory_stats(directory: Path) -> dict[str, os.stat_result]:
    if not directory.is_dir():
        return {}
    with os.scandir(directory) as entries:
        return {entry.name: entry.stat() for entry in entries}


def scan_shard(hs_dir: Path, shard_plan: dict) -> ShardScan:
    shard = shard_plan["shard"]
    shard_dir = layout.shard_dir(hs_dir, shard)
    stats = directory_stats(shard_dir)
    planned = {sample_id: tokens for sample_id, tokens, _ in shard_plan["samples"]}
    digests = {sample_id: digest for sample_id, _, digest in shard_plan["samples"]}
    _, records = layout.read_journal(layout.journal_path(shard_dir))
    done = [
        DoneFile(sample_id, record.tokens, record.bytes, stats[name].st_mtime)
        for sample_id, record in records.items()
        if digests.get(sample_id) == record.token_digest
        and (name := layout.file_name(sample_id)) in stats
        and stats[name].st_size == record.bytes
    ]
    written = {name for name in stats if layout.file_sample_id(name) is not None}
    return ShardScan(
        shard=shard,
        server=shard_plan["server"],
        planned=planned,
        done=done,
        in_flight_bytes=sum(st.st_size for name, st in stats.items() if layout.is_temp_file(name)),
        unjournaled_files=len(written - {layout.file_name(f.sample_id) for f in done}),
        heartbeat=read_json_or_none(layout.heartbeat_path(hs_dir, shard)),
        has_manifest=layout.shard_manifest_path(hs_dir, shard).exists(),
    )


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def shard_state(scan: ShardScan, check_pids: bool) -> tuple[str, str]:
    """(state, note). A shard whose heartbeat says loading/running but whose
    process no longer exists on this machine was killed: it counts as failed."""
    if scan.has_manifest:
        return "done", ""
    if scan.heartbeat is None:
        return "not started", ""
    status, pid = scan.heartbeat["status"], scan.heartbeat["pid"]
    if status in ACTIVE and check_pids and not process_alive(pid):
        return "failed", f"process {pid} is gone (heartbeat said {status})"
    return status, ""
