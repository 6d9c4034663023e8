"""The progress check's command line, ``draftflow progress``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from draftflow.progress.estimate import EXIT_CODES, check
from draftflow.progress.render import render_json, render_table, watch
from draftflow.progress.scan import Options, ProgressError
from draftflow.units import size_argument


def parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    codes = "; ".join(f"{code}: {meaning}" for code, meaning in EXIT_CODES.items())
    parser = argparse.ArgumentParser(
        prog=prog,
        description="How far the hidden-state extraction is, how fast, when it ends, and whether it fits.",
        epilog=f"exit codes: {codes}; 1: a file it needs is missing or unreadable (the extraction's plan.json, --configfile). "
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
    parser.add_argument("--free-bytes", type=size_argument, metavar="SIZE",
                        help="free space to plan with instead of the output filesystem's (e.g. 800G, 1.5TB, 2TiB)")  # fmt: skip
    parser.add_argument("--configfile", type=Path, nargs="+", action="extend", default=[], metavar="FILE",
                        help="the run's config file(s), as Snakemake took them: estimates what the later stages "
                        "(drafters, checkpoints, report) write")  # fmt: skip
    parser.add_argument("--reserve-bytes", type=size_argument, metavar="SIZE",
                        help="space the later stages need, instead of --configfile's estimate")  # fmt: skip
    parser.add_argument("--no-pid-check", dest="check_pids", action="store_false",
                        help="shards run on other machines: do not treat a missing local pid as a failed shard")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, prog: str = "draftflow progress") -> int:
    args = parse_args(argv, prog)
    options = Options(
        window_s=args.window,
        stall_after_s=args.stall_after,
        free_bytes=args.free_bytes,
        reserve_bytes=args.reserve_bytes,
        configs=tuple(args.configfile),
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
