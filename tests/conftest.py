"""Shared fixtures: the real workflow, run through the Snakemake CLI."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
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


# `make test` runs two pytest-xdist workers. The modules whose tests read the demo run
# go to one worker, which runs the demo once; every other module goes whole to a worker,
# so its module fixtures (a twin's run, a SLURM cluster) run once.
DEMO_MODULES = {
    "test_data_stages", "test_extract_stage", "test_faults", "test_gates", "test_multi_turn", "test_plan",
    "test_rebuilds", "test_resume_reproducibility", "test_server_faults", "test_train_evaluate_report", "test_storage_fp8",
}  # fmt: skip


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class DemoModulesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "demo" if Path(module).stem in DEMO_MODULES else module

    return DemoModulesTogether(config, log)


def pytest_itemcollected(item):
    if "workdir" in item.fixturenames and item.module.__name__.rsplit(".", 1)[-1] not in DEMO_MODULES:
        raise pytest.UsageError(f"{item.nodeid} reads the demo run: add its module to DEMO_MODULES in {__file__}")


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    """One working directory for every workflow test: the demo target is built once."""
    return tmp_path_factory.mktemp("workflow")


def finished_run(workdir: Path, config: dict, stages: tuple[str, ...] = ()) -> Path:
    """``config`` run to the end, starting from these stages of the demo (copied)."""
    for stage in stages:
        shutil.copytree(workdir / "results/demo" / stage, workdir / "results" / config["run"] / stage)
    snakemake(workdir, config)
    return workdir / "results" / config["run"]


def killed_twice_run(workdir: Path) -> tuple[Path, int]:
    """The demo config under run ``repeat``, SIGKILLed during generation and during training,
    then resumed; returns its results and how many answers the first kill left."""
    config = demo_config(run="repeat")
    results = workdir / "results/repeat"
    partial = results / "synthetic/work/generated-????????????????.jsonl"  # not .errors.jsonl
    kill_when(start_workflow(workdir, config), lambda: lines(partial) >= 40)
    answered_before_kill = lines(partial)
    checkpoint = results / "train/work/checkpoint.pt"
    kill_when(start_workflow(workdir, config), checkpoint.exists)
    snakemake(workdir, config, "--rerun-incomplete")
    return results, answered_before_kill


def start_workflow(workdir: Path, config: dict) -> subprocess.Popen:
    config_path = workdir / f"config-{config['run']}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    command = [str(SNAKEMAKE), "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
               "--configfile", str(config_path), "--cores", "2", "--rerun-incomplete"]  # fmt: skip
    return subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def kill_when(process: subprocess.Popen, ready, timeout_s: float = 900):
    """SIGKILL the workflow's process group as soon as ``ready()`` holds."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert process.poll() is None, "the workflow ended before the moment to kill it"
        assert time.monotonic() < deadline, "the moment to kill never came"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    unlock = [*process.args[:-1], "--unlock"]  # a killed Snakemake leaves its lock
    subprocess.run(unlock, check=True, capture_output=True)


def lines(path_pattern: Path) -> int:
    files = list(path_pattern.parent.glob(path_pattern.name))
    return sum(1 for _ in files[0].open()) if files else 0


# Whole runs that build on the demo and finish much later: started on threads as soon as
# the demo is done (those a collected test asks for), they use the cores the tests leave
# idle. Name of the fixture that waits for one -> what it runs.
BACKGROUND_RUNS = {
    "second_demo_run": lambda workdir: finished_run(workdir, demo_config(run="again")),
    # the demo's samples in fp8 storage (issue 15), its report set beside the demo's
    "fp8_run": lambda workdir: finished_run(
        workdir,
        demo_config(run="fp8", extract={"storage": "fp8"}, report={"compare_runs": ["demo"]}),
        ("prompts", "synthetic", "prepared", "vocab", "drafter_untrained"),
    ),
    "repeat_run": killed_twice_run,
}
BACKGROUND = pytest.StashKey[dict]()


@pytest.fixture(scope="session")
def demo_run(workdir, request) -> Path:
    """The default demo, run for real; returns its results directory."""
    snakemake(workdir, demo_config())
    wanted = {name for item in request.session.items for name in item.fixturenames} & set(BACKGROUND_RUNS)
    if wanted:
        pool = ThreadPoolExecutor(len(wanted), thread_name_prefix="background-run")
        request.config.stash[BACKGROUND] = {name: pool.submit(BACKGROUND_RUNS[name], workdir) for name in wanted}
        request.addfinalizer(lambda: pool.shutdown(wait=True))
    return workdir / "results/demo"


@pytest.fixture(scope="session")
def second_demo_run(request, demo_run) -> Path:
    """The demo config again under another run name, uninterrupted."""
    return request.config.stash[BACKGROUND]["second_demo_run"].result()


@pytest.fixture(scope="session")
def fp8_run(request, demo_run) -> Path:
    """The demo's prompts, answers, tokens, vocabulary and untrained drafter, extracted in
    fp8 storage, trained, evaluated and served; its report compares it with the demo."""
    return request.config.stash[BACKGROUND]["fp8_run"].result()


@pytest.fixture(scope="session")
def repeat_run(request, demo_run) -> tuple[Path, int]:
    """The demo config killed during generation and during training, then resumed."""
    return request.config.stash[BACKGROUND]["repeat_run"].result()


def copy_demo_run(demo_run, workdir, *stages):
    """The demo target and these stages' outputs in ``workdir``, with their mtimes:
    Snakemake there takes them as done and runs only the stages after them."""
    shutil.copytree(demo_run.parents[1] / "resources", workdir / "resources")
    for stage in stages:
        shutil.copytree(demo_run / stage, workdir / "results/demo" / stage)
    return workdir / "results/demo"
