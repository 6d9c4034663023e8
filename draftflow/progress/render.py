"""The check as a table, as bars redrawn until the extraction ends, as JSON."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

from draftflow.progress.estimate import (
    FAILED_SHARD,
    STALLED,
    WILL_NOT_FIT,
    Disk,
    Rates,
    Report,
    check,
)
from draftflow.progress.scan import Options
from draftflow.units import fmt_bytes, fmt_duration


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
