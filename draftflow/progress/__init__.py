"""Progress check of stage 5: how far, how fast, when it ends, and whether it fits.

``scan`` reads what the extraction leaves on disk, ``estimate`` makes the check
(rates, ETA, size, disk, stalls), ``render`` draws it, ``cli`` is the command
(``draftflow progress``). Standard library (and PyYAML for ``--configfile``) only,
so a check is fast.
"""

from draftflow.progress.cli import main
from draftflow.progress.estimate import FAILED_SHARD, ON_TRACK, STALLED, WILL_NOT_FIT, Report, check, target_model
from draftflow.progress.render import render_json, render_table, watch
from draftflow.progress.scan import Options, ProgressError

__all__ = ["FAILED_SHARD", "ON_TRACK", "STALLED", "WILL_NOT_FIT", "Options", "ProgressError", "Report", "check",
           "main", "render_json", "render_table", "target_model", "watch"]  # fmt: skip
