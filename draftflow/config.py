"""A run's config as the workflow sees it, for tools that read one outside Snakemake.

The Snakefile validates the config against ``draftflow/config_schema.yaml`` and fills in
its defaults; :func:`load_config` does the same for the progress check and the
plan, so the schema stays the one place a default is spelled.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import jsonschema
import yaml

SCHEMA = Path(__file__).resolve().with_name("config_schema.yaml")  # in the package: installed commands read it too


@functools.cache
def schema() -> dict:
    return yaml.safe_load(SCHEMA.read_text())


def with_defaults(value: dict, node: dict) -> dict:
    """``value`` with every missing property that has a default filled in, recursively."""
    filled = dict(value)
    for key, child in node.get("properties", {}).items():
        if key not in filled and "default" in child:
            filled[key] = child["default"]
        if isinstance(filled.get(key), dict) and "properties" in child:
            filled[key] = with_defaults(filled[key], child)
    return filled


def merged(base: dict, over: dict) -> dict:
    """``over``'s keys over ``base``'s, section by section, as Snakemake merges the files
    of ``--configfile A B``."""
    return {**base, **{key: merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict)
                       else value for key, value in over.items()}}  # fmt: skip


def load_config(*paths: Path) -> dict:
    """The YAML config files at ``paths``, merged as Snakemake merges them, checked
    against the schema, defaults filled in."""
    config = {}
    for path in paths:
        config = merged(config, yaml.safe_load(Path(path).read_text()) or {})
    try:
        jsonschema.validate(config, schema())
    except jsonschema.ValidationError as error:
        where = ".".join(map(str, error.absolute_path)) or "the top level"
        raise ValueError(f"{', '.join(map(str, paths))}: {where}: {error.message} (see {SCHEMA})") from None
    return with_defaults(config, schema())


def parameter_rows(node: dict, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) of every key under ``node``'s properties, depth first."""
    rows = []
    for name, child in node.get("properties", {}).items():
        key = f"{prefix}.{name}".lstrip(".")
        kind = child.get("type") or (" or ".join(map(json.dumps, child["enum"])) if "enum" in child else "")
        kind = " or ".join(kind) if isinstance(kind, list) else kind
        default = json.dumps(child["default"]) if "default" in child and "properties" not in child else ""
        description = " ".join(str(child.get("description", "")).split())
        rows.append((key, kind, default, description))
        rows += parameter_rows(child, key)
    return rows


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def parameter_table() -> str:
    """docs/configuration.md's table: every key of the schema, its type, default and what
    it does, then the fields of a prompt source (data.prompt_files, evaluate.datasets)."""
    source = next(option for option in schema()["$defs"]["prompt_source"]["oneOf"] if option.get("type") == "object")
    rows = parameter_rows(schema()) + parameter_rows(source, "<a prompt source>")
    lines = ["| key | type | default | what it does |", "| --- | --- | --- | --- |"]
    lines += [f"| `{key}` | {cell(kind)} | {f'`{cell(default)}`' if default else ''} | {cell(text)} |"
              for key, kind, default, text in rows]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(parameter_table())  # python -m draftflow.config: docs/configuration.md's table

