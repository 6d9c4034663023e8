"""The install tests' pip runs, as a user's fresh machine sees them: pip's configuration cleared.

They wait on the default index, not on the cores: `conftest.py` starts them in a
process of their own (``python -m tests.pip_runs FOLDER``) as soon as the
collection holds `test_install.py`, and the workers run other modules meanwhile.
Each run's result goes to ``FOLDER/<run>.json``; ``EARLY_WORK_DONE`` says all are there.

- ``cpu_install``: the CPU lock into a new venv through `make install`, its torch
  coming only from a stand-in of PyTorch's CPU index;
- ``cuda_lock``: the CUDA lock resolved by pip's own resolver (dry run, default
  index) for every supported Python found here;
- ``cpu_versions``: the CUDA set resolved with each CPU version it pins otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from packaging.markers import Marker

from draftflow import locks
from tests.conftest import EARLY_WORK_DONE, REPO


def cuda_lock_for(version: str) -> dict[str, str]:
    """The CUDA lock's pins that apply to Python ``version``, but for the data packages (the
    locks carry them without their dependencies: pip resolves the rest)."""
    data = {locks.canonical(requirement.split("==")[0]) for requirement in locks.data_packages()}
    pins = {}
    for line in locks.lock_path("cuda").read_text().splitlines():
        requirement, _, marker = line.partition(";")
        if not marker or Marker(marker).evaluate({"python_version": version}):
            name, pinned = requirement.split("==")
            if locks.canonical(name) not in data:
                pins[locks.canonical(name)] = pinned.strip()
    return pins


def torch_wheel(folder: Path) -> Path:
    """The locked CPU torch wheel, from pip's own sources here, else from PyTorch's index."""
    torch = f"torch=={locks.read_lock(locks.lock_path('cpu'))['torch']}"
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(folder), torch]
    if subprocess.run([*download, "--no-index"], capture_output=True).returncode != 0:
        index = os.environ.get("TORCH_INDEX", locks.TORCH_CPU_INDEX)
        subprocess.run([*download, "--index-url", index], check=True, capture_output=True)
    return next(folder.glob("torch-*.whl"))


def stand_in_torch_index(root: Path) -> str:
    """A PEP 503 index holding only the CPU torch wheel; returns its URL."""
    wheel = torch_wheel(root / "files")
    page = root / "simple" / "torch" / "index.html"
    page.parent.mkdir(parents=True)
    page.write_text(f'<html><body><a href="{wheel.as_uri()}">{wheel.name}</a></body></html>\n')
    return (root / "simple").as_uri()


def install_cpu_lock(folder: Path) -> dict:
    """`make install` of the CPU lock into a new venv in ``folder``, torch from a stand-in index."""
    index = stand_in_torch_index(folder / "torch-index")
    venv = folder / "venv"
    env = locks.default_index_environment()
    env.pop("VIRTUAL_ENV", None)
    install = subprocess.run(
        ["make", "-C", str(REPO), "install", f"VENV={venv}", f"TORCH_INDEX={index}"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    return {"venv": str(venv), "returncode": install.returncode, "output": install.stdout[-3000:] + install.stderr[-3000:]}


def resolve_cuda_lock() -> dict:
    """Per supported Python: the lock's pins and what pip resolves; the versions not found here."""
    found = {version: locks.find_python(version) for version in locks.SUPPORTED_PYTHONS}
    versions = [version for version, python in found.items() if python]
    expected = [cuda_lock_for(version) for version in versions]
    requirements = [[f"{name}=={pinned}" for name, pinned in pins.items()] for pins in expected]
    resolved = concurrently(lambda args: locks.resolve(*args), [(found[v], r) for v, r in zip(versions, requirements)])
    return {
        "resolved": [[version, pins, got] for version, pins, got in zip(versions, expected, resolved)],
        "missing_pythons": [version for version, python in found.items() if not python],
    }


def resolve_cuda_set_with_cpu_versions() -> dict[str, str]:
    """Each package the CUDA set pins otherwise -> what pip says of the CPU lock's version."""
    cpu = locks.read_lock(locks.lock_path("cpu"))
    packages = sorted(locks.CUDA_OWN_VERSIONS)

    def refused(package: str) -> str:
        pin = f"{package}=={cpu[package].split('+')[0]}"
        try:
            locks.resolve(sys.executable, locks.direct_requirements("cuda"), [pin])
        except locks.LockError as error:
            return str(error)
        return f"{pin} resolved"

    return dict(zip(packages, concurrently(refused, packages)))


def concurrently(function, arguments: list) -> list:
    """pip's runs wait mostly on the index: run them side by side."""
    with ThreadPoolExecutor(max(1, len(arguments))) as pool:
        return list(pool.map(function, arguments))


def record(folder: Path, name: str, run) -> None:
    """``run()``'s result, or the traceback it raised, in ``folder/name.json`` (atomically)."""
    try:
        result = {"result": run()}
    except Exception:
        result = {"error": traceback.format_exc()}
    partial = folder / f"{name}.json.partial"
    partial.write_text(json.dumps(result))
    partial.replace(folder / f"{name}.json")


def main(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    runs = {
        "cpu_install": lambda: install_cpu_lock(folder / "cpu-install"),
        "cuda_lock": resolve_cuda_lock,
        "cpu_versions": resolve_cuda_set_with_cpu_versions,
    }
    with ThreadPoolExecutor(len(runs)) as pool:
        list(pool.map(lambda item: record(folder, *item), runs.items()))
    (folder / EARLY_WORK_DONE).touch()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
