"""Two runs' files compared as the reproducibility claims word it: the same bytes,
but for what records when, where or in which order the work happened."""

from __future__ import annotations

import hashlib
import json
from fnmatch import fnmatch
from pathlib import Path

# Files that record when, where or in which order the work happened, not what it made.
IN_COMPLETION_ORDER = ("hidden_states/shard-*/journal.jsonl",)
# Stats fields that say how long this run worked, in how many jobs, or how much of the answers it asked itself.
TIMINGS = {"synthetic/stats.json": {"server_seconds", "response_tokens_per_second", "conversations_asked", "response_tokens_generated",
                                    "servers"},
           "train/stats.json": {"seconds_this_run", "supervised_tokens_per_second"}}  # fmt: skip
NOT_COMPARED = {
    "synthetic/jobs/*": "each generation job's record of its share: what it asked, for how long",
    "synthetic/work/*": "the answer store: rows as asked (under content keys, naming the server's random port), "
    "also those of other configs of the folder (generated.jsonl, compared, is this config's, as asked)",
    "run_plan.md": "free space and the rates of earlier runs, at the start; the first run in a folder has none",
    "run_plan.json": "free space and the rates of earlier runs, at the start; the first run in a folder has none",
    "hidden_states/plan.json": "free space at the start, and the files earlier runs left to keep",
    "hidden_states/progress.json": "when it was checked",
    "hidden_states/progress.txt": "when it was checked",
    "hidden_states/shard-*.heartbeat.json": "process ids and times",
    "drafter_untrained/run.yaml": "speculators records its temporary save folder",
    "drafter_untrained/train_command.txt": "speculators records the time",
    "drafter_untrained/speculators.patch": "speculators records the uncommitted changes of the checkout that ran",
    "train/work/*/checkpoint.pt": "the resume state: a resumed run's holds the same tensors, but torch.save "
    "lays out a state it loaded in another order (compared by tensor in the resume test)",
    "train/work/*/epochs/*": "each epoch's drafter and its figure, in the training key's folder, whose name digests "
    "files that name the run's place (drafter_trained/ is the best of them, and train/stats.json holds every figure)",
    "provenance.json": "digests of hidden_states/plan.json and drafter_untrained (above)",
    "report/*": "stage runtimes",
}


def files_under(results: Path) -> set[str]:
    return {str(path.relative_to(results)) for path in results.rglob("*") if path.is_file()}


def assert_same_files(
    first: Path,
    second: Path,
    renames: dict[bytes, bytes] | None = None,
    *,
    stages: tuple[str, ...] | None = None,
    left_out: tuple[str, ...] = (),
) -> set[str]:
    """Assert that two runs' ``results/<run>`` hold the same files with the same content
    (``renames``: bytes of ``second`` that name its own place, as ``first`` names it);
    the names compared. ``stages``: the stage folders compared, where a run was rerun to a
    nearer target in an earlier run's folder, whose other stages hold that run's files;
    within each, every file counts. ``left_out``: patterns of files that only ``first``
    was run to make."""
    kept = lambda name: not any(fnmatch(name, p) for p in (*NOT_COMPARED, *left_out)) and (  # noqa: E731
        stages is None or Path(name).parts[0] in stages
    )
    names, theirs = ({n for n in files_under(results) if kept(n)} for results in (first, second))
    assert names == theirs
    renames = dict(renames or {})
    renames.update(digests_of_renamed_files(first, second, names, renames))
    for name in sorted(names):
        one, other = first / name, second / name
        if any(fnmatch(name, pattern) for pattern in IN_COMPLETION_ORDER):
            assert sorted(one.read_text().splitlines()) == sorted(other.read_text().splitlines()), name
        elif name in TIMINGS:
            timed = [{k: v for k, v in json.loads(r.read_text()).items() if k not in TIMINGS[name]} for r in (one, other)]
            assert timed[0] == timed[1], name
        else:
            assert one.read_bytes() == renamed(other.read_bytes(), renames), name
    return names


def renamed(data: bytes, renames: dict[bytes, bytes]) -> bytes:
    for theirs, ours in renames.items():
        data = data.replace(theirs, ours)
    return data


def digests_of_renamed_files(first: Path, second: Path, names: set[str], renames: dict[bytes, bytes]) -> dict[bytes, bytes]:
    """A file that names its own place (the drafter's config names the target's folder)
    has another sha256 in each place, and so has what lists its digest (the model card):
    those digests, as renames too, where the file is the same but for its place."""
    digests = {}
    for name in names:
        ours, theirs = (first / name).read_bytes(), (second / name).read_bytes()
        if ours != theirs and ours == renamed(theirs, renames):
            digests[hashlib.sha256(theirs).hexdigest().encode()] = hashlib.sha256(ours).hexdigest().encode()
    return digests
