"""Shared fixtures: the real workflow, run through the Snakemake CLI."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from filelock import FileLock

from draftflow.report import COMPARED_FILES
from draftflow.vllm_registry import CACHE_DIR_ENV
from draftflow.vllm_server import logged_server_pids
from tests.scopes import module_of, scope

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = Path(sys.executable).with_name("snakemake")
DRAFTFLOW = Path(sys.executable).with_name("draftflow")  # the command the docs show, installed with the checkout
# The suite's own draftflow cache (issue 43): it leaves the user's ~/.cache/draftflow as it was.
# Set here, in the process that starts the xdist workers, before it starts them: they share it.
SUITE_CACHE = None if CACHE_DIR_ENV in os.environ else tempfile.mkdtemp(prefix="draftflow-suite-cache-")
if SUITE_CACHE:
    os.environ[CACHE_DIR_ENV] = SUITE_CACHE
# OpenMP threads that wait for work sleep instead of spinning: the suite runs two workers, their
# workflows' jobs and vLLM servers on two cores, where a spinning thread takes the core another
# process needs. A vLLM CPU server answering 16 requests of 32 tokens one at a time beside a busy
# suite: 17.0 CPU-s and 15.5 s by default, 2.5 and 2.5 with PASSIVE (bench/omp_wait_policy.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def demo_config(evaluation_sets: bool = True, **overrides) -> dict:
    """The default demo config, with top-level sections updated by ``overrides``; without
    ``evaluation_sets``, its MT-Bench set, K sweep and temperature 1 left out (runs of their
    own, not continuing the demo's, save its 80 conversations, two serve_check servers and
    an evaluation over a twin's whole vocabulary)."""
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    if not evaluation_sets:
        config["evaluate"] = {key: value for key, value in config["evaluate"].items()
                              if key not in ("datasets", "draft_token_sweep", "temperatures")}  # fmt: skip
    for key, value in overrides.items():
        if isinstance(value, dict):
            config[key] = {**config.get(key, {}), **value}
        else:
            config[key] = value
    return config


def config_file(workdir: Path, config: dict, sort_keys: bool = True) -> Path:
    """``config`` (its keys sorted, or in its own order) in a file of ``workdir`` named by its
    run and content: two workers' runs in one folder (the demo's) never read each other's
    config, or one half written."""
    text = yaml.safe_dump(config, sort_keys=sort_keys)
    path = workdir / f"config-{config['run']}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.yaml"
    if not path.exists():
        partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        partial.write_text(text)
        partial.replace(path)
    return path


def snakemake(
    workdir: Path, config: dict, *args: str, check: bool = True, workflow: Path = REPO, sort_keys: bool = True
) -> subprocess.CompletedProcess:
    """Run the workflow (the checkout's, or a ``workflow_copy``) in ``workdir`` with
    ``config`` (written with its keys sorted, or in its own order); output is captured."""
    config_path = config_file(workdir, config, sort_keys)
    command = [
        str(SNAKEMAKE),
        "--snakefile", str(workflow / "Snakefile"),
        "--directory", str(workdir),
        "--configfile", str(config_path),
        "--cores", "2",
        *args,
    ]  # fmt: skip
    # a copy's own draftflow, ahead of the checkout's editable install in the venv
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(workflow), os.environ.get("PYTHONPATH")]))}
    # its own session, stopped with all its jobs if the test ends first: on Ctrl-C,
    # Snakemake would finish its running jobs, minutes after pytest is gone
    running = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = running.communicate()
    finally:
        stop_group(running)
    process = subprocess.CompletedProcess(command, running.returncode, stdout, stderr)
    if check and process.returncode != 0:
        pytest.fail(f"snakemake failed ({process.returncode}):\n{process.stderr[-6000:]}")
    return process


WORKFLOW_FILES = ("Snakefile", "rules", "scripts", "draftflow", "demo", "config", "envs", "profiles", "pyproject.toml")


def plan_before_running(workdir: Path, config: dict, workflow: Path = REPO) -> dict:
    """What ``python -m draftflow.plan`` (the workflow's, the checkout's or a copy's) says
    a run of ``config`` in ``workdir`` will redo, before it runs: its JSON."""
    config_path = config_file(workdir, config)
    command = [sys.executable, "-m", "draftflow.plan", "--configfile", str(config_path), "--directory", str(workdir),
               "--gpus", "0", "--json"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(workflow), os.environ.get("PYTHONPATH")]))}
    process = subprocess.run(command, capture_output=True, text=True, env=env, cwd=workdir)
    assert process.returncode == 0, process.stderr
    return json.loads(process.stdout)


def workflow_copy(folder: Path) -> Path:
    """The workflow's code copied into ``folder``, for a test that edits it: the
    checkout, which other tests and runs execute, stays as it is."""
    for name in WORKFLOW_FILES:
        source, target = REPO / name, folder / name
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)
    return folder


# `make test` runs two pytest-xdist workers. Each module goes whole to a worker, so its
# module fixtures (a SLURM cluster) run once, but for the modules whose module fixture is a run
# per parameter (a twin's): each parameter's tests go whole to a worker. The demo's run is the
# session's, whichever worker asks first (``demo_run``).
# Work that waits on the network, not on the cores: started in a process of its own as soon
# as the collection holds the module that reads it, which runs last, so that the workers run
# the other modules meanwhile. Module -> what runs, as `python -m RUNS FOLDER`
# (``early_work_results``).
EARLY_WORK = {"test_install": "tests.pip_runs"}  # pip against the default index: 2-8 minutes, 202 CPU-s (2026-12-08)
EARLY_WORK_DONE = "done"  # the file early work writes last, beside its results
EARLY_WORK_TIMEOUT_S = 1800


# The order in which the workers take the scopes that run a minute or more, with the seconds
# each took in a suite run on 2 cores (--durations=0 of a fresh clone's `CI=true bash .ci/run`,
# 2026-12-08, AMD EPYC; `bench/suite_budget.py` prints them; the demo's run counted in the
# module that asked for it first): the demo first (every module after it reads it, and the
# background run starts from it) beside the runs that need no demo, then the longest first,
# so that none is left with a long one at the end. The incremental module starts after the
# first minutes: its plan test holds a run's times to the rates its first run measured, and
# pip's install (EARLY_WORK) and the demo's target build load both cores at the start (its
# first run once generated 20 times slower there than later).
SCHEDULE = (
    "test_train_evaluate_report",  # 770, the demo's run included
    "test_twin_workflows[gpt_oss]",  # 560 (beside the demo's target build and pip's install)
    "test_incremental_rebuilds",  # 1094
    "test_walkthrough",  # 496
    "test_server_faults",  # 369
    "test_twin_workflows[qwen3_moe]",  # 350
    "test_resume_reproducibility",  # 319
    "test_thinking_recipe",  # 230
    "test_twin_workflows[kimi_k25]",  # 224
    "test_slurm",  # 206
    "test_twin_workflows[deepseek_v3]",  # 202
    "test_faults",  # 161
    "test_gates",  # 152
    "test_gemma3_ways_out",  # 149
    "test_rebuilds",  # 125
    "test_pilot",  # 106
    "test_training_key",  # 76
    "test_extract_stage",  # 73
    "test_families",  # 63
    "test_epoch_selection",  # 47
    "test_multi_turn",  # 43
    "test_mla_rope",  # 42
    "test_vllm_hidden_states_connector",  # 37
    "test_vllm_support",  # 37
)


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class DemoModulesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope(nodeid)

    config.option.loadscopereorder = False  # the workers' collection order is the schedule
    return DemoModulesTogether(config, log)


def pytest_collection_modifyitems(items):
    """The SCHEDULE first, then the scopes with more tests; those reading early work last."""
    tests = Counter(scope(item.nodeid) for item in items)

    def order(item):
        unit = scope(item.nodeid)
        rank = SCHEDULE.index(unit) if unit in SCHEDULE else len(SCHEDULE)
        return module_of(item.nodeid) in EARLY_WORK, rank, -tests[unit], unit

    items.sort(key=order)


def pytest_xdist_node_collection_finished(node, ids):
    start_early_work(node.config, {module_of(nodeid) for nodeid in ids})


def pytest_collection_finish(session):
    if not hasattr(session.config, "workerinput") and not session.config.pluginmanager.hasplugin("dsession"):
        start_early_work(session.config, {module_of(item.nodeid) for item in session.items})


def session_folder(config) -> Path:
    """The session's temporary folder, the same in the controller and every xdist worker."""
    base = config._tmp_path_factory.getbasetemp()
    return base.parent if hasattr(config, "workerinput") else base


def start_early_work(config, modules: set[str]) -> None:
    """In the process that lives the whole session (xdist's controller): stopped at its end."""
    for module in modules & EARLY_WORK.keys() - config.stash.setdefault(EARLY_STARTED, set()):
        folder = session_folder(config) / EARLY_WORK[module]
        folder.mkdir()
        with (folder / "output.log").open("w") as output:
            process = subprocess.Popen([sys.executable, "-m", EARLY_WORK[module], str(folder)], cwd=REPO,
                                       start_new_session=True, stdout=output, stderr=subprocess.STDOUT)  # fmt: skip
        STARTED.append(process)
        config.stash[EARLY_STARTED].add(module)


EARLY_STARTED = pytest.StashKey[set]()


def early_work_results(config, module: str) -> dict:
    """Each run's result of ``module``'s early work (``FOLDER/<run>.json``), once all are
    there; fails with the work's output after EARLY_WORK_TIMEOUT_S."""
    folder = session_folder(config) / EARLY_WORK[module]
    deadline = time.monotonic() + EARLY_WORK_TIMEOUT_S
    while not (folder / EARLY_WORK_DONE).exists():
        if time.monotonic() > deadline:
            output = folder / "output.log"
            pytest.fail(f"{EARLY_WORK[module]} not done after {EARLY_WORK_TIMEOUT_S} s:\n"
                        f"{output.read_text()[-6000:] if output.exists() else 'never started'}")  # fmt: skip
        time.sleep(1)
    return {path.stem: json.loads(path.read_text()) for path in folder.glob("*.json")}


@pytest.fixture(scope="session")
def workdir(request) -> Path:
    """The demo's working directory, one for the session's xdist workers: the demo target is
    built and the demo run once (``demo_run``). Tests run none of their own workflows in it:
    another Snakemake there would lock the demo target it shares (they copy it, ``copy_demo_run``)."""
    folder = session_folder(request.config) / "workflow"
    folder.mkdir(exist_ok=True)
    return folder


DEMO_DONE = ".demo-done"  # written in the workdir once the demo run has finished


@pytest.fixture(scope="session")
def demo_run(workdir, request) -> Path:
    """The default demo, run for real once in the session (the first worker to ask runs it,
    holding a lock the others wait on); returns its results directory. The worker that ran it
    then starts the BACKGROUND_RUNS the collection asks for."""
    with FileLock(workdir.parent / "demo.lock"):
        if not (workdir / DEMO_DONE).exists():
            snakemake(workdir, demo_config())
            (workdir / DEMO_DONE).touch()
            wanted = {name for item in request.session.items for name in item.fixturenames}
            for name in BACKGROUND_RUNS.keys() & wanted:
                start_background_run(name, workdir / "results/demo", session_folder(request.config) / name)
    return workdir / "results/demo"


# Whole runs that build on the demo and only finish much later: started in the background
# as soon as the demo is done (when a collected test asks for them), they use the cores the
# workers leave idle; each in a folder of its own. Name of the fixture that waits for one ->
# its config, and the demo's stages it starts from (copied).
BACKGROUND_RUNS = {
    # the demo's samples in fp8 storage (issue 15), its report set beside the demo's
    "fp8_run": (
        lambda: demo_config(False, run="fp8", extract={"storage": "fp8"}, report={"compare_runs": ["demo"]}),
        ("prompts", "synthetic", "prepared", "vocab", "drafter_untrained"),
    ),
}
BACKGROUND_EXIT, BACKGROUND_GROUP = "exit-code", "process-group"  # what a background run's folder holds
BACKGROUND_RUN_TIMEOUT_S = 1800  # a whole demo-sized run takes 5-10 minutes on 2 busy cores


def start_background_run(name: str, demo: Path, folder: Path) -> None:
    """The background run ``name`` in ``folder``, the demo's target and stages copied there (and
    the files its report compares, COMPARED_FILES), in a session of its own: it outlives the
    worker that started it (the controller stops it at the session's end), and writes its exit
    code when done."""
    config, stages = BACKGROUND_RUNS[name][0](), BACKGROUND_RUNS[name][1]
    shutil.copytree(demo.parents[1] / "resources", folder / "resources")
    for stage in stages:
        shutil.copytree(demo / stage, folder / "results" / config["run"] / stage)
    for path in COMPARED_FILES.values():
        (folder / "results/demo" / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(demo / path, folder / "results/demo" / path)
    command = shlex.join([str(SNAKEMAKE), "--snakefile", str(REPO / "Snakefile"), "--directory", str(folder),
                          "--configfile", str(config_file(folder, config)), "--cores", "2"])  # fmt: skip
    with (folder / "snakemake.out").open("w") as output:
        process = subprocess.Popen(["sh", "-c", f"{command}; echo $? > {BACKGROUND_EXIT}"], cwd=folder,
                                   stdout=output, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    (folder / BACKGROUND_GROUP).write_text(str(process.pid))


@pytest.fixture(scope="session")
def fp8_run(request, demo_run) -> Path:
    """The demo's prompts, answers, tokens, vocabulary and untrained drafter, extracted in
    fp8 storage, trained, evaluated and served; its report compares it with the demo."""
    return background_run(request, "fp8_run")


def background_run(request, name: str) -> Path:
    """Wait for the background run ``name`` (BACKGROUND_RUNS), at most
    BACKGROUND_RUN_TIMEOUT_S; its results directory."""
    folder = session_folder(request.config) / name
    deadline = time.monotonic() + BACKGROUND_RUN_TIMEOUT_S
    while not (folder / BACKGROUND_EXIT).exists() or not (folder / BACKGROUND_EXIT).read_text().strip():
        if time.monotonic() > deadline:
            pytest.fail(f"the background run {name} ran past {BACKGROUND_RUN_TIMEOUT_S} s:\n{background_output(folder)}")
        time.sleep(1)
    if returncode := int((folder / BACKGROUND_EXIT).read_text()):
        pytest.fail(f"the background run {name} failed ({returncode}):\n{background_output(folder)}")
    return folder / "results" / BACKGROUND_RUNS[name][0]()["run"]


def background_output(folder: Path) -> str:
    return (folder / "snakemake.out").read_text()[-6000:]


def start_snakemake(workdir: Path, config: dict, *args: str) -> subprocess.Popen:
    """The workflow in the background, in a process group of its own; its output in
    ``workdir/snakemake-<run>.out`` (``output_tail``)."""
    config_path = config_file(workdir, config)
    command = [str(SNAKEMAKE), "--snakefile", str(REPO / "Snakefile"), "--directory", str(workdir),
               "--configfile", str(config_path), "--cores", "2", *args]  # fmt: skip
    output_path = workdir / f"snakemake-{config['run']}.out"
    with output_path.open("w") as output:
        process = subprocess.Popen(command, start_new_session=True, stdout=output, stderr=subprocess.STDOUT)
    process.workdir, process.output_path = workdir, output_path
    STARTED.append(process)
    return process


STARTED: list[subprocess.Popen] = []  # this worker's background runs: none outlives the session


def pytest_configure(config):
    signal.signal(signal.SIGTERM, interrupted)  # stopped from outside: tear down as on Ctrl-C


def interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_sessionfinish(session, exitstatus):
    for process in STARTED:
        stop_group(process)
    if not hasattr(session.config, "workerinput"):  # the controller, after every worker: the background runs
        for group in session_folder(session.config).glob(f"*/{BACKGROUND_GROUP}"):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(group.read_text()), signal.SIGKILL)


def pytest_unconfigure(config):
    if SUITE_CACHE:
        shutil.rmtree(SUITE_CACHE, ignore_errors=True)


def complete_lines(path: Path) -> int:
    """Lines of a file a workflow may be appending to, the one it is writing left out."""
    return path.read_bytes().count(b"\n") if path.exists() else 0


def output_tail(process: subprocess.Popen) -> str:
    return process.output_path.read_text()[-6000:]


MOMENT_TIMEOUT_S = 1200  # a moment of a demo-sized run (a server up, a shard's 11th file) on 2 busy cores


def wait_until(ready, process: subprocess.Popen, moment: str, timeout_s: float = MOMENT_TIMEOUT_S) -> None:
    """Poll ``ready()`` while the background workflow runs; fail, with its output's
    tail, when it ends first or ``timeout_s`` pass (a bound for a broken run, not a pace)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if process.poll() is not None:
            pytest.fail(f"the workflow ended ({process.returncode}) before {moment}:\n{output_tail(process)}")
        if time.monotonic() > deadline:
            stop_group(process)
            pytest.fail(f"{moment} did not come in {timeout_s} s:\n{output_tail(process)}")
        time.sleep(0.05)


def wait_for_exit(process: subprocess.Popen, timeout_s: float) -> int:
    """The background workflow's exit code; stopped, failing with its output's tail,
    after ``timeout_s``."""
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(process)
        pytest.fail(f"the workflow ran past {timeout_s} s and was stopped:\n{output_tail(process)}")


def pause_group(process: subprocess.Popen) -> None:
    """Stop the background workflow and its jobs where they are (SIGSTOP), for a test
    to look at a moment that would otherwise pass; ``stop_group`` still kills it."""
    os.killpg(process.pid, signal.SIGSTOP)


def stop_group(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def server_groups_gone_within(server_log: Path, seconds: float) -> bool:
    """Whether no process is left in the process group of any server ``server_log``'s starts
    started (their pids, as draftflow logs them; reaping takes a moment): only processes the
    test's own run started are looked at, never others by name or port."""
    pids = logged_server_pids(server_log.read_text())
    assert pids, f"{server_log} logs no server's pid"
    deadline = time.monotonic() + seconds
    while any(group_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def copy_demo_run(demo_run, workdir, *stages):
    """The demo target and these stages' outputs in ``workdir``, with their mtimes:
    Snakemake there takes them as done and runs only the stages after them."""
    shutil.copytree(demo_run.parents[1] / "resources", workdir / "resources")
    for stage in stages:
        shutil.copytree(demo_run / stage, workdir / "results/demo" / stage)
    return workdir / "results/demo"
