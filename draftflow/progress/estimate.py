"""How fast the extraction goes, when it ends, what it writes, whether it fits: the check."""

from __future__ import annotations

import bisect
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from draftflow import run_folder
from draftflow.config import load_config
from draftflow.costs import LATER_OUTPUTS, later_stage_bytes, tree_bytes
from draftflow.extract import layout
from draftflow.progress.scan import (
    ACTIVE,
    DoneFile,
    Options,
    ShardScan,
    hidden_states_dir,
    read_extraction_plan,
    scan_shard,
    shard_state,
)
from draftflow.target_model import TargetModel, read_target_model
from draftflow.target_source import resolve_target
from draftflow.units import fmt_bytes, fmt_duration

ON_TRACK, WILL_NOT_FIT, FAILED_SHARD, STALLED = 0, 3, 4, 5
EXIT_CODES = {
    ON_TRACK: "on track (or finished)",
    WILL_NOT_FIT: "will not fit: the projection and the later stages exceed the free space",
    FAILED_SHARD: "a shard failed (heartbeat says so, or its process is gone)",
    STALLED: "stalled: no shard has advanced for --stall-after seconds",
}
STATES = ("running", "loading", "done", "not started", "failed")
MTIME_SLACK_S = 0.05



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
            f"--configfile: no target config at {path.resolve()}; run from the workflow directory or pass --reserve-bytes"
        )
    return read_target_model(path.parent)


def later_stages(options: Options, plan: dict, run_dir: Path) -> tuple[int, str, dict[str, dict[str, int]]]:
    """(bytes the later stages still write, where the figure comes from, per output).

    Per output, what is already written under results/<run>/ is subtracted
    from the estimate, so a check after those stages ran asks for little.
    """
    if options.reserve_bytes is not None:
        return options.reserve_bytes, "--reserve-bytes", {}
    if not options.configs:
        return 0, "not counted: pass --configfile or --reserve-bytes", {}
    config = load_config(*options.configs)
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
    return needed, f"estimated from {', '.join(map(str, options.configs))}", detail


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
