"""Progress check of stage 5: how far, how fast, when it ends, and whether it fits.

Reads only what the extraction leaves under ``results/<run>/hidden_states/``:

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

Standard library (and PyYAML for ``--config``) only, so a check is fast:
draftflow.extract.hidden_states is not imported because it imports torch.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import shutil
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TextIO

from draftflow import run_folder
from draftflow.config import load_config
from draftflow.costs import LATER_OUTPUTS, later_stage_bytes, tree_bytes
from draftflow.extract import layout
from draftflow.target_model import TargetModel, read_target_model
from draftflow.target_source import resolve_target
from draftflow.units import fmt_bytes, fmt_duration, parse_size

ON_TRACK, WILL_NOT_FIT, FAILED_SHARD, STALLED = 0, 3, 4, 5
EXIT_CODES = {
    ON_TRACK: "on track (or finished)",
    WILL_NOT_FIT: "will not fit: the projection and the later stages exceed the free space",
    FAILED_SHARD: "a shard failed (heartbeat says so, or its process is gone)",
    STALLED: "stalled: no shard has advanced for --stall-after seconds",
}
STATES = ("running", "loading", "done", "not started", "failed")
ACTIVE = ("loading", "running")
MTIME_SLACK_S = 0.05


@dataclass(frozen=True)
class Options:
    window_s: float = 300.0
    stall_after_s: float = 600.0
    free_bytes: int | None = None  # instead of the measured free space
    reserve_bytes: int | None = None  # what the later stages need, instead of --config's estimate
    config: Path | None = None
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


@dataclass
class ShardReport:
    shard: int
    state: str  # not started | loading | running | done | failed
    samples_done: int
    samples_total: int
    tokens_done: int
    tokens_total: int
    bytes_done: int
    bytes_in_flight: int
    unjournaled_files: int
    recent_tokens_per_s: float | None
    pid: int | None
    note: str


@dataclass
class Rates:
    window_s: float
    extracting_s: float  # wall time during which at least one shard's model was ready
    samples_per_s: float | None
    tokens_per_s: float | None
    recent_s: float  # extracting time the recent rates cover (at most window_s)
    recent_samples_per_s: float | None
    recent_tokens_per_s: float | None


@dataclass
class Eta:
    seconds: float | None
    extracting_s: float | None  # remaining tokens at the recent token rate
    loading_s: float | None  # model loads still ahead, spread over the server jobs running side by side
    pending_loads: int  # server jobs that still have to load the model
    ends_at: float | None


@dataclass
class Size:
    bytes_done: int
    bytes_per_token: float | None  # measured: bytes of done files / their tokens
    data_bytes_per_token: float | None  # measured from a file's safetensors header
    header_bytes_per_file: float | None  # measured mean overhead of done files
    projected_exact: int  # done bytes + every remaining sample's own size
    projected_linear: int | None  # bytes so far / samples so far * total samples
    plan_bound: int  # plan.json: the same sum with a 256-byte header bound per file


@dataclass
class Disk:
    path: str
    free: int
    free_source: str
    extraction_left: int
    later_stages: int
    later_stages_source: str
    later_stages_detail: dict[str, dict[str, int]]
    headroom: int
    fits: bool


@dataclass
class Stall:
    last_advance_at: float | None
    seconds_since: float | None
    stall_after_s: float
    stalled: bool


@dataclass
class Report:
    hidden_states: str
    checked_at: float
    complete: bool
    samples_done: int
    samples_total: int
    tokens_done: int
    tokens_total: int
    shard_states: dict[str, int]
    shards: list[ShardReport]
    rates: Rates
    eta: Eta
    size: Size
    disk: Disk
    stall: Stall
    problems: list[str]
    exit_code: int


# -- reading the run directory ------------------------------------------------


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


# -- rates: extracting time is the union of the shards' [model ready, end] ----


def this_attempt(scan: ShardScan) -> list[DoneFile]:
    """Files finished since the current attempt's model became ready.

    mtimes come from the kernel's coarse clock, a few ms behind time.time().
    """
    ready = (scan.heartbeat or {}).get("model_ready_at")
    if ready is None:
        return []
    return [
        replace(f, finished_at=max(f.finished_at, ready))
        for f in scan.done
        if f.finished_at >= ready - MTIME_SLACK_S
    ]


def extraction_span(scan: ShardScan, state: str, now: float) -> tuple[float, float] | None:
    heartbeat = scan.heartbeat or {}
    ready = heartbeat.get("model_ready_at")
    if ready is None:
        return None
    if state == "running":
        return ready, now
    return ready, max([heartbeat["updated_at"], *(f.finished_at for f in scan.done)])


def merged(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    union: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if union and start <= union[-1][1]:
            union[-1] = (union[-1][0], max(union[-1][1], end))
        else:
            union.append((start, end))
    return union


def last_stretch(spans: list[tuple[float, float]], seconds: float) -> list[tuple[float, float]]:
    """The last ``seconds`` of the union, walking back over gaps (model loads)."""
    stretch = []
    for start, end in reversed(spans):
        if seconds <= 0:
            break
        stretch.insert(0, (max(start, end - seconds), end))
        seconds -= end - stretch[0][0]
    return stretch


def length(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def within(files: list[DoneFile], spans: list[tuple[float, float]]) -> list[DoneFile]:
    starts = [start for start, _ in spans]
    inside = []
    for f in files:
        k = bisect.bisect_right(starts, f.finished_at) - 1
        if k >= 0 and f.finished_at <= spans[k][1]:
            inside.append(f)
    return inside


def per_second(files: list[DoneFile], spans: list[tuple[float, float]]) -> tuple[float | None, float | None]:
    """(samples/s, tokens/s) of the files finished within ``spans``."""
    seconds = length(spans)
    if seconds <= 0:
        return None, None
    inside = within(files, spans)
    return len(inside) / seconds, sum(f.tokens for f in inside) / seconds


def measure_rates(timed: list[tuple[tuple[float, float], list[DoneFile]]], window_s: float) -> Rates:
    spans = merged(span for span, _ in timed)
    files = [f for _, shard_files in timed for f in shard_files]
    recent = last_stretch(spans, window_s)
    return Rates(
        window_s, length(spans), *per_second(files, spans), length(recent), *per_second(files, recent)
    )


def estimate_eta(
    scans: list[ShardScan], states: list[str], remaining_tokens: int, rates: Rates, now: float
) -> Eta:
    """Remaining tokens at the recent token rate, plus the model loads still ahead.

    Loads follow server jobs, not shards. A server job with unfinished shards
    and none running (not started, or killed: a failed shard) needs a full load
    (the mean measured ``model_ready_at - started_at`` of the shards that
    loaded), a loading one the rest of it; loads of server jobs that run side
    by side overlap, so the sum is divided by their number.
    """
    loads = [
        h["model_ready_at"] - h["started_at"]
        for s in scans
        if (h := s.heartbeat) and h.get("model_ready_at") and h["loads_model"]
    ]
    servers: dict[int, list[tuple[ShardScan, str]]] = {}
    for scan, state in zip(scans, states, strict=True):
        servers.setdefault(scan.server, []).append((scan, state))
    if remaining_tokens == 0:
        return Eta(0.0, 0.0, 0.0, 0, now)
    mean_load = sum(loads) / len(loads) if loads else None
    ahead = [load_still_ahead(shards, mean_load, now) for shards in servers.values()]
    pending = sum(load != 0.0 for load in ahead)
    if not rates.recent_tokens_per_s or mean_load is None:
        return Eta(None, None, None, pending, None)
    active = sum(any(state in ACTIVE for _, state in shards) for shards in servers.values())
    loading = sum(ahead) / max(1, active)
    extracting = remaining_tokens / rates.recent_tokens_per_s
    return Eta(extracting + loading, extracting, loading, pending, now + extracting + loading)


def load_still_ahead(shards: list[tuple[ShardScan, str]], mean_load: float | None, now: float) -> float | None:
    """Seconds of model loading one server job still has ahead (None: a load of unknown length)."""
    states = [state for _, state in shards]
    if all(state == "done" for state in states) or "running" in states:
        return 0.0
    loading = [scan for scan, state in shards if state == "loading"]
    if loading and not loading[0].heartbeat["loads_model"]:
        return 0.0  # between two shards of a server job that holds the model
    if mean_load is None:
        return None
    if loading:
        return max(0.0, mean_load - (now - loading[0].heartbeat["started_at"]))
    return mean_load


# -- size: exact from each remaining sample's tokens, and the naive line ------


def data_bytes_per_token(path: Path, tokens: int) -> float:
    """Tensor bytes per token of one safetensors file (its size less the header)."""
    with path.open("rb") as stream:
        header = 8 + int.from_bytes(stream.read(8), "little")
    return (path.stat().st_size - header) / tokens


def project_size(hs_dir: Path, plan: dict, scans: list[ShardScan]) -> Size:
    done = [f for s in scans for f in s.done]
    done_bytes = sum(f.bytes for f in done)
    if not done:
        return Size(0, None, None, None, plan["bytes"], None, plan["bytes"])
    sample = next(s for s in scans if s.done)
    per_token = data_bytes_per_token(
        layout.shard_dir(hs_dir, sample.shard) / layout.file_name(sample.done[0].sample_id), sample.done[0].tokens
    )
    done_tokens = sum(f.tokens for f in done)
    header = (done_bytes - per_token * done_tokens) / len(done)
    finished = {(s.shard, f.sample_id) for s in scans for f in s.done}
    remaining = [
        tokens for s in scans for sample_id, tokens in s.planned.items() if (s.shard, sample_id) not in finished
    ]
    return Size(
        bytes_done=done_bytes,
        bytes_per_token=done_bytes / done_tokens,
        data_bytes_per_token=per_token,
        header_bytes_per_file=header,
        projected_exact=round(done_bytes + per_token * sum(remaining) + header * len(remaining)),
        projected_linear=round(done_bytes / len(done) * plan["samples"]),
        plan_bound=plan["bytes"],
    )


# -- disk: free space against the rest of the extraction and the later stages -


def target_model(config: dict) -> TargetModel:
    """The target's text model (``target.path`` relative to the workflow directory, the cwd, or a hub id)."""
    path = resolve_target(config["target"]["path"]).folder / "config.json"
    if not path.exists():
        raise FileNotFoundError(
            f"--config: no target config at {path.resolve()}; run from the workflow directory or pass --reserve-bytes"
        )
    return read_target_model(path.parent)


def later_stages(options: Options, plan: dict, run_dir: Path) -> tuple[int, str, dict[str, dict[str, int]]]:
    """(bytes the later stages still write, where the figure comes from, per output).

    Per output, what is already written under results/<run>/ is subtracted
    from the estimate, so a check after those stages ran asks for little.
    """
    if options.reserve_bytes is not None:
        return options.reserve_bytes, "--reserve-bytes", {}
    if options.config is None:
        return 0, "not counted: pass --config or --reserve-bytes", {}
    config = load_config(options.config)
    estimate = later_stage_bytes(
        config, target_model(config), len(plan["layer_ids"]), tree_bytes(run_folder.stage_dir(run_dir, "prepare") / "dataset")
    )
    detail = {
        output: {
            "estimated": estimate[output],
            "written": sum(tree_bytes(run_dir / name) for name in LATER_OUTPUTS[output]),
        }
        for output in estimate
    }
    needed = sum(max(0, d["estimated"] - d["written"]) for d in detail.values())
    return needed, f"estimated from {options.config}", detail


def check_disk(hs_dir: Path, size: Size, in_flight: int, options: Options, plan: dict) -> Disk:
    measured = options.free_bytes is None
    free = shutil.disk_usage(hs_dir).free if measured else options.free_bytes
    extraction_left = max(0, size.projected_exact - size.bytes_done - in_flight)
    later, source, detail = later_stages(options, plan, hs_dir.parent)
    headroom = free - extraction_left - later
    return Disk(
        path=str(hs_dir),
        free=free,
        free_source="measured" if measured else "--free-bytes",
        extraction_left=extraction_left,
        later_stages=later,
        later_stages_source=source,
        later_stages_detail=detail,
        headroom=headroom,
        fits=headroom >= 0,
    )


# -- the check ----------------------------------------------------------------


def last_advance(scans: list[ShardScan]) -> float | None:
    times = [f.finished_at for s in scans for f in s.done]
    for s in scans:
        heartbeat = s.heartbeat or {}
        times += [heartbeat[k] for k in ("started_at", "model_ready_at", "updated_at") if heartbeat.get(k)]
    return max(times, default=None)


def detect_stall(
    scans: list[ShardScan], states: list[str], complete: bool, options: Options, now: float
) -> Stall:
    """Stalled: unfinished, no shard loading a model, and nothing new for ``stall_after_s``."""
    last = last_advance(scans)
    since = None if last is None else now - last
    stalled = not complete and "loading" not in states and since is not None and since > options.stall_after_s
    return Stall(last, since, options.stall_after_s, stalled)


def shard_report(scan: ShardScan, state: str, note: str, window_s: float, now: float) -> ShardReport:
    span = extraction_span(scan, state, now)
    recent = per_second(this_attempt(scan), last_stretch([span], window_s))[1] if span else None
    return ShardReport(
        shard=scan.shard,
        state=state,
        samples_done=len(scan.done),
        samples_total=len(scan.planned),
        tokens_done=sum(f.tokens for f in scan.done),
        tokens_total=sum(scan.planned.values()),
        bytes_done=sum(f.bytes for f in scan.done),
        bytes_in_flight=scan.in_flight_bytes,
        unjournaled_files=scan.unjournaled_files,
        recent_tokens_per_s=recent,
        pid=(scan.heartbeat or {}).get("pid"),
        note=note,
    )


def find_problems(shards: list[ShardReport], disk: Disk, stall: Stall) -> list[tuple[int, str]]:
    """(exit code, message) of each problem; the lowest code is the exit code."""
    problems = []
    if not disk.fits:
        short = f"{fmt_bytes(-disk.headroom)} short"
        needs = f"hidden states still need {fmt_bytes(disk.extraction_left)}, later stages {fmt_bytes(disk.later_stages)}"
        problems.append(
            (WILL_NOT_FIT, f"will not fit: {needs}, but only {fmt_bytes(disk.free)} are free ({short})")
        )
    if failed := [str(s.shard) for s in shards if s.state == "failed"]:
        problems.append(
            (FAILED_SHARD, f"failed shard(s): {', '.join(failed)}; rerun snakemake, done files are kept")
        )
    if stall.stalled:
        since = f"{fmt_duration(stall.seconds_since)} (--stall-after {stall.stall_after_s:g} s)"
        problems.append((STALLED, f"stalled: no shard has advanced for {since}"))
    return problems


def check(run_dir: Path, options: Options = Options(), now: float | None = None) -> Report:
    """Everything the report shows, for ``results/<run>`` (or its hidden_states/)."""
    now = time.time() if now is None else now
    hs_dir = hidden_states_dir(Path(run_dir))
    plan = read_extraction_plan(hs_dir)
    scans = [scan_shard(hs_dir, shard_plan) for shard_plan in plan["shards"]]
    states, notes = zip(*(shard_state(s, options.check_pids) for s in scans), strict=True)
    shards = [
        shard_report(s, state, note, options.window_s, now)
        for s, state, note in zip(scans, states, notes, strict=True)
    ]
    timed = [
        (span, this_attempt(s))
        for s, state in zip(scans, states, strict=True)
        if (span := extraction_span(s, state, now))
    ]
    rates = measure_rates(timed, options.window_s)
    tokens_done = sum(s.tokens_done for s in shards)
    complete = all(state == "done" for state in states)
    size = project_size(hs_dir, plan, scans)
    disk = check_disk(hs_dir, size, sum(s.bytes_in_flight for s in shards), options, plan)
    stall = detect_stall(scans, list(states), complete, options, now)
    problems = find_problems(shards, disk, stall)
    return Report(
        hidden_states=str(hs_dir),
        checked_at=now,
        complete=complete,
        samples_done=sum(s.samples_done for s in shards),
        samples_total=plan["samples"],
        tokens_done=tokens_done,
        tokens_total=plan["tokens"],
        shard_states={state: states.count(state) for state in STATES},
        shards=shards,
        rates=rates,
        eta=estimate_eta(scans, list(states), plan["tokens"] - tokens_done, rates, now),
        size=size,
        disk=disk,
        stall=stall,
        problems=[message for _, message in problems],
        exit_code=min((code for code, _ in problems), default=ON_TRACK),
    )


# -- output -------------------------------------------------------------------


def fmt_rate(value: float | None, unit: str) -> str:
    return "—" if value is None else f"{value:,.1f} {unit}"


def percent(done: int, total: int) -> float:
    return 100.0 * done / total if total else 100.0


def table(header: list[str], rows: list[list[str]], left: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        cells = [
            c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    return [line(row) for row in [header, *rows]]


def row(
    label: str, state: str, samples: tuple[int, int], tokens: tuple[int, int], size: int,
    rate: float | None, note: str,
) -> list[str]:  # fmt: skip
    return [
        label, state, f"{samples[0]:,}/{samples[1]:,}", f"{tokens[0]:,}/{tokens[1]:,}",
        f"{percent(*tokens):.1f}%", fmt_bytes(size), fmt_rate(rate, ""), note,
    ]  # fmt: skip


def shard_rows(report: Report) -> list[list[str]]:
    rows = [
        row(str(s.shard), s.state, (s.samples_done, s.samples_total), (s.tokens_done, s.tokens_total),
            s.bytes_done, s.recent_tokens_per_s, s.note)
        for s in report.shards
    ]  # fmt: skip
    total = row("total", "", (report.samples_done, report.samples_total), (report.tokens_done, report.tokens_total),
                report.size.bytes_done, report.rates.recent_tokens_per_s, "")  # fmt: skip
    return [*rows, total]


def rate_line(r: Rates) -> str:
    if r.tokens_per_s is None:
        return "rate       — (no shard's model is ready yet)"
    return (
        f"rate       {fmt_rate(r.recent_tokens_per_s, 'tok/s')}, {fmt_rate(r.recent_samples_per_s, 'samples/s')} "
        f"over the last {fmt_duration(r.recent_s)} of extraction; overall {fmt_rate(r.tokens_per_s, 'tok/s')}, "
        f"{fmt_rate(r.samples_per_s, 'samples/s')} in {fmt_duration(r.extracting_s)} (model loading excluded)"
    )


def eta_line(report: Report) -> str:
    e = report.eta
    if report.complete:
        return "ETA        finished"
    if report.rates.tokens_per_s is None:
        return "ETA        unknown until a shard's model is ready and files finish"
    if e.seconds is None:
        return f"ETA        unknown: no file finished in the last {fmt_duration(report.rates.window_s)} of extraction"
    ends = time.strftime("%a %H:%M", time.localtime(e.ends_at))
    return (
        f"ETA        {fmt_duration(e.seconds)}, ends ~{ends}: {report.tokens_total - report.tokens_done:,} tokens left "
        f"at the recent rate take {fmt_duration(e.extracting_s)}, {e.pending_loads} model load(s) ahead "
        f"{fmt_duration(e.loading_s)}"
    )


def size_line(report: Report) -> str:
    z = report.size
    if z.projected_linear is None:
        return f"size       projected total {fmt_bytes(z.projected_exact)} (plan.json, header bound); no file done yet"
    return (
        f"size       {z.bytes_per_token:,.1f} B/token measured; projected total {fmt_bytes(z.projected_exact)} exact "
        f"(each remaining sample's tokens), {fmt_bytes(z.projected_linear)} linear (bytes per sample so far "
        f"x {report.samples_total:,}: {z.projected_linear / z.projected_exact - 1:+.1%})"
    )


def disk_line(d: Disk) -> str:
    return (
        f"disk       {fmt_bytes(d.free)} free{'' if d.free_source == 'measured' else ' (--free-bytes)'}; "
        f"hidden states still need {fmt_bytes(d.extraction_left)}, later stages {fmt_bytes(d.later_stages)} "
        f"({d.later_stages_source}); headroom {fmt_bytes(d.headroom)}"
    )


STATUS = {WILL_NOT_FIT: "WILL NOT FIT", FAILED_SHARD: "FAILED SHARD", STALLED: "STALLED"}


def summary_lines(report: Report) -> list[str]:
    states = ", ".join(f"{n} {state}" for state, n in report.shard_states.items() if n)
    status = STATUS.get(report.exit_code, "FINISHED" if report.complete else "ON TRACK")
    return [
        f"shards     {states}",
        rate_line(report.rates),
        eta_line(report),
        size_line(report),
        disk_line(report.disk),
        *(f"WARNING    {message}" for message in report.problems),
        f"status     {status} (exit {report.exit_code})",
    ]


def render_table(report: Report) -> str:
    header = ["shard", "state", "samples", "tokens", "done", "size", "recent tok/s", "note"]
    checked = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(report.checked_at))
    lines = [f"{report.hidden_states}  (checked {checked})", ""]
    lines += table(header, shard_rows(report), left={1, 7})
    return "\n".join([*lines, "", *summary_lines(report)]) + "\n"


BLOCKS = " ▏▎▍▌▋▊▉█"


def bar(fraction: float, width: int = 30) -> str:
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + (BLOCKS[part] if part else "")).ljust(width)


def bar_line(
    label: str, tokens: tuple[int, int], samples: tuple[int, int], state: str, rate: float | None
) -> str:
    """A tqdm-like line; the bar fills with tokens, which is what the time goes to."""
    fraction = tokens[0] / tokens[1] if tokens[1] else 1.0
    count = f"{samples[0]:,}/{samples[1]:,}"
    return f"{label:>9} |{bar(fraction)}| {fraction:6.1%} {count:>13} samples  {state:<11} {fmt_rate(rate, 'tok/s')}"


def render_bars(report: Report) -> str:
    lines = [f"{report.hidden_states}  {time.strftime('%H:%M:%S', time.localtime(report.checked_at))}", ""]
    lines += [
        bar_line(f"shard {s.shard}", (s.tokens_done, s.tokens_total), (s.samples_done, s.samples_total),
                 s.state, s.recent_tokens_per_s)
        for s in report.shards
    ]  # fmt: skip
    lines.append(bar_line("total", (report.tokens_done, report.tokens_total),
                          (report.samples_done, report.samples_total), "", report.rates.recent_tokens_per_s))  # fmt: skip
    return "\n".join([*lines, "", *summary_lines(report)]) + "\n"


def render_json(report: Report) -> str:
    return json.dumps(asdict(report), indent=2) + "\n"


CLEAR_SCREEN = "\x1b[H\x1b[2J"


def watch(run_dir: Path, options: Options, interval_s: float, out: TextIO = sys.stdout) -> int:
    """Redraw the bars every ``interval_s`` until every shard is done (or Ctrl-C)."""
    report = check(run_dir, options)
    clear = CLEAR_SCREEN if out.isatty() else "\n"
    try:
        while True:
            out.write(clear + render_bars(report))
            out.flush()
            if report.complete:
                break
            time.sleep(interval_s)
            report = check(run_dir, options)
    except KeyboardInterrupt:
        pass
    return report.exit_code


# ---------------------------------------------------------------- command line


def size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    codes = "; ".join(f"{code}: {meaning}" for code, meaning in EXIT_CODES.items())
    parser = argparse.ArgumentParser(
        description="How far the hidden-state extraction is, how fast, when it ends, and whether it fits.",
        epilog=f"exit codes: {codes}; 1: a file it needs is missing (plan.json, --config). "
        "When several apply, the lowest wins; --json lists them all.",
    )
    parser.add_argument("run_dir", type=Path, help="results/<run> (or results/<run>/hidden_states)")
    parser.add_argument("--json", action="store_true", help="print the full report as JSON")
    parser.add_argument("--watch", nargs="?", type=float, const=10.0, metavar="SECONDS",
                        help="redraw progress bars every SECONDS (default 10) until every shard is done")  # fmt: skip
    parser.add_argument("--window", type=float, default=Options.window_s, metavar="SECONDS",
                        help="extracting time the recent rate (and the ETA) covers (default %(default)g)")  # fmt: skip
    parser.add_argument("--stall-after", type=float, default=Options.stall_after_s, metavar="SECONDS",
                        help="warn (exit 5) when no shard has advanced for this long and none is loading "
                        "(default %(default)g)")  # fmt: skip
    parser.add_argument("--free-bytes", type=size, metavar="SIZE",
                        help="free space to plan with instead of the output filesystem's (e.g. 800G, 1.5TB, 2TiB)")  # fmt: skip
    parser.add_argument("--config", type=Path, metavar="YAML",
                        help="the run's config: estimates what the later stages (drafters, checkpoints, report) write")  # fmt: skip
    parser.add_argument("--reserve-bytes", type=size, metavar="SIZE",
                        help="space the later stages need, instead of --config's estimate")  # fmt: skip
    parser.add_argument("--no-pid-check", dest="check_pids", action="store_false",
                        help="shards run on other machines: do not treat a missing local pid as a failed shard")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    options = Options(
        window_s=args.window,
        stall_after_s=args.stall_after,
        free_bytes=args.free_bytes,
        reserve_bytes=args.reserve_bytes,
        config=args.config,
        check_pids=args.check_pids,
    )
    try:
        if args.watch is not None:
            return watch(args.run_dir, options, args.watch)
        report = check(args.run_dir, options)
    except (ProgressError, FileNotFoundError) as error:
        print(f"progress: {error}", file=sys.stderr)
        return 1
    print(render_json(report) if args.json else render_table(report), end="")
    return report.exit_code
