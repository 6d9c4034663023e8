"""Shared fixtures: the real workflow, run through the Snakemake CLI."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = Path(sys.executable).with_name("snakemake")


def demo_config(**overrides) -> dict:
    """The default demo config, with top-level sections updated by ``overrides``."""
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    for key, value in overrides.items():
        if isinstance(value, dict):
            config[key] = {**config.get(key, {}), **value}
        else:
            config[key] = value
    return config


def snakemake(
    workdir: Path, config: dict, *args: str, check: bool = True
) -> subprocess.CompletedProcess:
    """Run the workflow in ``workdir`` with ``config``; output is captured."""
    config_path = workdir / f"config-{config['run']}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    command = [
        str(SNAKEMAKE),
        "--snakefile", str(REPO / "Snakefile"),
        "--directory", str(workdir),
        "--configfile", str(config_path),
        "--cores", "2",
        *args,
    ]  # fmt: skip
    process = subprocess.run(command, capture_output=True, text=True)
    if check and process.returncode != 0:
        pytest.fail(f"snakemake failed ({process.returncode}):\n{process.stderr[-6000:]}")
    return process


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    """One working directory for every workflow test: the demo target is built once."""
    return tmp_path_factory.mktemp("workflow")


@pytest.fixture(scope="session")
def demo_run(workdir) -> Path:
    """The default demo, run for real; returns its results directory."""
    snakemake(workdir, demo_config())
    return workdir / "results/demo"


def copy_demo_run(demo_run, workdir, *stages):
    """The demo target and these stages' outputs in ``workdir``, with their mtimes:
    Snakemake there takes them as done and runs only the stages after them."""
    shutil.copytree(demo_run.parents[1] / "resources", workdir / "resources")
    for stage in stages:
        shutil.copytree(demo_run / stage, workdir / "results/demo" / stage)
    return workdir / "results/demo"
