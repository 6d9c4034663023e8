"""What produced a run: config, code, package versions, target and stage inputs."""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import subprocess
from pathlib import Path

from draftflow.fingerprint import file_sha256, target_fingerprint
from draftflow.vllm_registry import installed_version, vllm_builds

PACKAGE_ROOT = Path(__file__).resolve().parent
# The workflow's packages, beside each other in its folder: draftflow and the demo's builders.
WORKFLOW_PACKAGES = ("draftflow", "demo")
PACKAGES = ("snakemake", "speculators", "hs-connectors", "torch", "transformers", "safetensors", "datasets", "tokenizers")


def module_file(name: str) -> Path | None:
    """The file of the workflow's module ``name`` (a package's ``__init__.py``), if it is one."""
    if name.split(".", 1)[0] not in WORKFLOW_PACKAGES:
        return None
    base = PACKAGE_ROOT.parent.joinpath(*name.split("."))
    return next((path for path in (base.with_suffix(".py"), base / "__init__.py") if path.is_file()), None)


def named_modules(tree: ast.Module) -> set[str]:
    """Modules a file imports, and those it names in strings (loaded by name: the
    connector vLLM's server imports, a module run with ``python -m``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return names


@functools.cache
def direct_imports(path: Path, mtime_ns: int, size: int) -> frozenset[Path]:
    """The workflow's module files that ``path`` (as of ``mtime_ns`` and ``size``) names,
    with the packages that hold them: parsed once per version of a file, as each rule's
    ``code_version`` reaches the same modules (1.8 s of every Snakemake start otherwise)."""
    found = set()
    for name in named_modules(ast.parse(path.read_text())):
        parts = name.split(".")
        found |= set(filter(None, (module_file(".".join(parts[:n])) for n in range(1, len(parts) + 1))))
    return frozenset(found)


def workflow_imports(path: Path) -> set[Path]:
    """The workflow's module files that ``path`` runs, directly or through others, with
    the packages that hold them."""
    found: set[Path] = set()
    pending = [path]
    while pending:
        file = pending.pop()
        stat = file.stat()
        for module in direct_imports(file, stat.st_mtime_ns, stat.st_size) - found:
            found.add(module)
            pending.append(module)
    return found


def code_version(script: str | Path) -> str:
    """Hash of the workflow's modules a rule's script runs.

    Snakemake tracks the script itself, not the modules it imports; a rule
    that passes this as a param reruns when any of them changes.
    """
    digest = hashlib.sha256()
    for module in sorted(workflow_imports(Path(script))):
        # named from draftflow's folder: the rules that run no demo module keep the versions earlier runs recorded
        digest.update(os.path.relpath(module, PACKAGE_ROOT).encode() + module.read_bytes())
    return digest.hexdigest()[:16]


def path_digest(path: Path) -> str:
    """sha256 of a file, or of a directory's (relative path, file sha256) listing.

    Symlinks count by where they point: the hidden-state files they reach are
    covered by the shard manifests' checksums, and rehashing them is slow.
    """
    if path.is_file():
        return file_sha256(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file() or p.is_symlink()):
        content = f"-> {os.readlink(file)}" if file.is_symlink() else file_sha256(file)
        digest.update(f"{file.relative_to(path)}:{content}\n".encode())
    return digest.hexdigest()


def git_commit(repo: Path) -> str:
    try:
        commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{commit}{' (uncommitted changes)' if dirty else ''}"


def package_versions() -> dict[str, str]:
    """The packages' versions, the vLLM build that is installed, and the CUDA torch was built for."""
    import torch  # only here: the rest of the module serves Snakemake's parse

    versions = {name: installed_version(name) or "not installed" for name in PACKAGES}
    versions["vllm"] = ", ".join(vllm_builds()) or "not installed"
    versions["torch cuda"] = torch.version.cuda or "none (a CPU build)"
    return versions


def provenance(
    config: dict, target: Path, target_hub: dict | None, stage_inputs: dict[str, list[str]]
) -> dict:
    """``target_hub``: the hub id, revision asked and commit ``target`` was resolved from (None for a
    local folder). ``stage_inputs``: rule name → its input paths (the target is fingerprinted, not hashed).
    The workflow's commit is its checkout's, where jobs import draftflow from (PYTHONPATH)."""
    target = target.resolve()
    return {
        "config": config,
        "workflow_commit": git_commit(Path(__file__).resolve().parents[1]),
        "packages": package_versions(),
        "target": {"path": str(target), "hub": target_hub, "fingerprint": target_fingerprint(target)},
        "stage_inputs": {
            stage: {path: path_digest(Path(path)) for path in paths if Path(path).resolve() != target}
            for stage, paths in stage_inputs.items()
        },
    }
