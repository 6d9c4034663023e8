"""What makes a shard's files, whose hash is the key on its journal's first line
(``layout.ExtractionSettings``): listed in ``draftflow.dependencies``, built here so
that the extract_plan job's code version covers only the extraction's modules."""

from __future__ import annotations

from pathlib import Path

from draftflow.extract.layout import ExtractionSettings
from draftflow.fingerprint import model_identity
from draftflow.provenance import PACKAGE_ROOT, code_version
from draftflow.server_flags import extraction_server_flags
from draftflow.vllm_registry import installed_version, vllm_builds

EXTRACTION_PACKAGES = ("torch", "transformers")  # both backends run their layers; vllm's build is added


def extraction_code(backend: str) -> dict:
    """The code and package builds that make a hidden-state file's bytes: the backend's
    modules (the connector vLLM's server loads included) and the shard writer's."""
    modules = [PACKAGE_ROOT / "extract" / f"{backend}_backend.py", PACKAGE_ROOT / "extract" / "shards.py"]
    builds = {name: installed_version(name) or "not installed" for name in EXTRACTION_PACKAGES}
    if backend == "vllm":
        builds["vllm"] = ", ".join(vllm_builds()) or "not installed"
    return {"code": "+".join(code_version(module) for module in modules), "builds": builds}


def extraction_settings(
    backend: str, layer_ids: list[int], dtype: str, storage: str, target: Path, server_args: list[str]
) -> ExtractionSettings:
    """The model, the layers, dtype and storage, the extraction code and packages, and
    for the vllm backend its server's flags."""
    code = extraction_code(backend)
    flags = tuple(extraction_server_flags(server_args)) if backend == "vllm" else ()
    builds = tuple(sorted(code["builds"].items()))
    return ExtractionSettings(backend, tuple(layer_ids), dtype, model_identity(target), storage, code["code"], builds, flags)
