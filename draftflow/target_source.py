"""Where the target's files are: ``target.path`` as a local model folder, or a
Hugging Face id (``org/name``, ``org/name@revision``) resolved offline through
the local hub cache.

Nothing is downloaded: a model missing from the cache stops the workflow with
the command that fetches it. Rules take the snapshot folder as input, and the
cache keeps one per commit, so a branch that moves to another commit reruns
them.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import asdict, dataclass
from pathlib import Path

# Hub repo ids: two names of word characters, '.' and '-', each starting and
# ending with a word character, without '--' or '..' (huggingface_hub's rules).
NAME = r"\w(?:[\w.-]*\w)?"
HUB_ID = re.compile(rf"(?P<repo_id>{NAME}/{NAME})(?:@(?P<revision>\S+))?")
DEFAULT_REVISION = "main"
# A snapshot folder in a hub cache: models--<org>--<name>/snapshots/<commit>.
SNAPSHOT_FOLDER = re.compile(r"/models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})$")


class TargetNotFoundError(FileNotFoundError):
    """target.path is neither a local folder nor a model in the hub cache; the message says how to fetch it."""


@dataclass(frozen=True)
class HubRevision:
    repo_id: str
    revision: str  # as asked: a branch, a tag or a commit
    commit: str


@dataclass(frozen=True)
class TargetSource:
    folder: Path
    hub: HubRevision | None  # None for a local folder

    def hub_record(self) -> dict | None:
        return asdict(self.hub) if self.hub else None


def hub_id_match(path: str) -> re.Match | None:
    match = HUB_ID.fullmatch(path)
    return match if match and "--" not in match["repo_id"] and ".." not in match["repo_id"] else None


def resolve_target(path: str, workflow_builds: Collection[str] = ()) -> TargetSource:
    """The model folder ``target.path`` names.

    An existing folder, or one the workflow builds itself, is taken as it is;
    otherwise a path shaped like a hub id is looked up in the hub cache.
    """
    match = hub_id_match(path)
    if match is None or Path(path).is_dir() or path in workflow_builds:
        return TargetSource(Path(path), None)
    repo_id, revision = match["repo_id"], match["revision"] or DEFAULT_REVISION
    folder = cached_snapshot(repo_id, revision, f"target.path {path!r} is no folder ({Path(path).resolve()})")
    return TargetSource(folder, HubRevision(repo_id, revision, folder.name))


def cached_snapshot(repo_id: str, revision: str, named_by: str, repo_type: str = "model") -> Path:
    """The cache's snapshot folder of ``repo_id`` (a model or a dataset) at ``revision`` (branch
    and tag names read from refs/); ``named_by`` says which setting named it, for the error."""
    # Imported here: only hub ids need huggingface_hub, and a login node may run Snakemake without it.
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    cache = Path(constants.HF_HUB_CACHE)
    try:
        folder = snapshot_download(repo_id, repo_type=repo_type, revision=revision, cache_dir=cache, local_files_only=True)
        return Path(folder)
    except LocalEntryNotFoundError as error:
        incomplete = f" ({error})" if isinstance(error, IncompleteSnapshotError) else ""
        type_flag = "" if repo_type == "model" else f" --repo-type {repo_type}"
        raise TargetNotFoundError(
            f"{named_by}: the Hugging Face cache {cache} holds no complete snapshot of the {repo_type} "
            f"{repo_id} at revision {revision!r}{incomplete}. The workflow downloads nothing; fetch it into "
            f"that cache first (HF_HOME or HF_HUB_CACHE choose it): hf download{type_flag} {repo_id} --revision {revision}"
        ) from None


def snapshot_identity(folder: str | Path) -> str | None:
    """``org/name@commit`` when ``folder`` is a snapshot folder of a hub cache, else None."""
    match = SNAPSHOT_FOLDER.search(Path(folder).resolve().as_posix())
    return f"{match['org']}/{match['name']}@{match['commit']}" if match else None
