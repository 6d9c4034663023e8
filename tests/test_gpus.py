"""GPU placement on one machine (draftflow.gpus) and where jobs run (draftflow.job_placement), with fake device lists."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from itertools import combinations
from pathlib import Path

import pytest
import yte

from draftflow import gpus, job_placement
from tests.conftest import REPO, SNAKEMAKE, demo_config, snakemake

PYTHON = sys.executable


def fake_env(tmp_path: Path, devices: str = "0,1,2,3") -> dict[str, str]:
    """The environment of a machine with ``devices``, its own lock folder, outside SLURM."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != gpus.CUDA}
    env.update({gpus.ENV_DEVICES: devices, gpus.ENV_LOCK_DIR: str(tmp_path / "locks")})
    return env


def overlapping(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


def assert_disjoint_while_overlapping(records: list[dict]) -> int:
    """Jobs that held devices at the same time held different ones; returns how many pairs overlapped."""
    pairs = 0
    for a, b in combinations(records, 2):
        if overlapping(a, b):
            pairs += 1
            assert not set(a["ids"]) & set(b["ids"]), (a, b)
    return pairs


# --- which devices exist --------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"DRAFTFLOW_GPUS": "0,1,2,3"}, ["0", "1", "2", "3"]),
        ({"DRAFTFLOW_GPUS": " 2, 5 "}, ["2", "5"]),
        ({"DRAFTFLOW_GPUS": "none", "CUDA_VISIBLE_DEVICES": "0,1"}, []),
        ({"DRAFTFLOW_GPUS": "0,1", "CUDA_VISIBLE_DEVICES": "3"}, ["0", "1"]),
        ({"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}, ["GPU-aa", "GPU-bb"]),
        ({"CUDA_VISIBLE_DEVICES": ""}, []),
        # SLURM's assignment beats everything the user's shell exported into the job
        ({"SLURM_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": "1", "DRAFTFLOW_GPUS": "0,1,2,3"}, ["1"]),
        ({"SLURM_JOB_ID": "7", "SLURM_STEP_GPUS": "2,3", "DRAFTFLOW_GPUS": "0"}, ["2", "3"]),
        # a SLURM job that got no GPU list falls back like any other process
        ({"SLURM_JOB_ID": "7", "DRAFTFLOW_GPUS": "0,1"}, ["0", "1"]),
    ],
)
def test_device_list_comes_from_slurm_then_draftflow_gpus_then_cuda_visible_devices(environ, expected):
    assert gpus.visible_devices(environ) == expected
    assert gpus.local_gpu_count(environ) == len(expected)


def test_locks_of_a_slurm_job_live_in_a_folder_of_that_job(tmp_path):
    base = {gpus.ENV_LOCK_DIR: str(tmp_path)}
    assert gpus.default_lock_dir(base) == tmp_path
    assert gpus.default_lock_dir({**base, "SLURM_JOB_ID": "41"}) == tmp_path / "slurm-41"


# --- claiming in one process ------------------------------------------------------------


def test_claim_sets_cuda_visible_devices_and_restores_it_even_on_failure(tmp_path):
    environ = {"DRAFTFLOW_GPUS": "0,1,2,3", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    with gpus.claim_gpus(2, lock_dir=tmp_path, environ=environ) as first:
        assert environ["CUDA_VISIBLE_DEVICES"] == ",".join(first) and len(first) == 2
        with gpus.claim_gpus(2, lock_dir=tmp_path, environ=environ) as second:
            assert not set(first) & set(second)
            assert environ["CUDA_VISIBLE_DEVICES"] == ",".join(second)
        assert environ["CUDA_VISIBLE_DEVICES"] == ",".join(first)
    assert environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"

    environ = {"DRAFTFLOW_GPUS": "0,1"}
    with pytest.raises(RuntimeError, match="server died"):
        with gpus.claim_gpus(2, lock_dir=tmp_path, environ=environ):
            raise RuntimeError("server died")
    assert "CUDA_VISIBLE_DEVICES" not in environ
    with gpus.claim_gpus(2, lock_dir=tmp_path, environ=environ, timeout_s=0) as again:
        assert again == ["0", "1"]  # released by the failed block


def test_zero_gpus_hold_nothing_and_leave_the_environment_alone(tmp_path):
    environ = {"DRAFTFLOW_GPUS": "none", "CUDA_VISIBLE_DEVICES": "5"}
    with gpus.claim_gpus(0, lock_dir=tmp_path, environ=environ) as ids:
        assert ids == [] and environ["CUDA_VISIBLE_DEVICES"] == "5"
    assert not any(tmp_path.iterdir())


def test_more_gpus_than_exist_fail_at_once_saying_where_the_list_came_from(tmp_path):
    errors: list[Exception] = []

    def claim_eight() -> None:
        try:
            with gpus.claim_gpus(8, lock_dir=tmp_path, environ={"DRAFTFLOW_GPUS": "0,1"}, timeout_s=3600):
                pass
        except gpus.GpuClaimError as error:
            errors.append(error)

    claimer = threading.Thread(target=claim_eight, daemon=True)
    claimer.start()
    claimer.join(60)
    assert not claimer.is_alive(), "the claim waited (up to its hour-long timeout) instead of failing"
    assert len(errors) == 1 and "needs 8 GPU(s) but 2 are visible (from DRAFTFLOW_GPUS" in str(errors[0])
    with pytest.raises(ValueError):
        with gpus.claim_gpus(-1, lock_dir=tmp_path, environ={}):
            pass


def test_a_claim_waits_for_a_release_and_times_out_when_none_comes(tmp_path):
    environ = {"DRAFTFLOW_GPUS": "0,1"}
    with gpus.claim_gpus(2, lock_dir=tmp_path, environ=environ):
        with pytest.raises(gpus.GpuClaimError, match="no 1 free GPU"):
            with gpus.claim_gpus(1, lock_dir=tmp_path, environ=dict(environ), timeout_s=0.3, poll_s=0.05):
                pass
        holders = gpus.holders(["0", "1"], tmp_path)
        assert all(holder and holder["pid"] == os.getpid() for holder in holders.values())

    got: list[list[str]] = []
    first = gpus.claim_gpus(2, lock_dir=tmp_path, environ=dict(environ))
    first.__enter__()

    def wait_for_one() -> None:
        with gpus.claim_gpus(1, lock_dir=tmp_path, environ=dict(environ), timeout_s=10, poll_s=0.05) as ids:
            got.append(ids)

    waiter = threading.Thread(target=wait_for_one)
    waiter.start()
    time.sleep(0.3)
    assert not got  # still waiting
    first.__exit__(None, None, None)
    waiter.join(10)
    assert got == [["0"]]
    assert gpus.holders(["0", "1"], tmp_path) == {"0": None, "1": None}


# --- claiming across processes ------------------------------------------------------------

# A job holding its devices marks it in holding/ and keeps them until a second job
# has marked too: at least two jobs hold devices at once, whatever the machine's load
# (the deadline only bounds a broken run).
HOLD = textwrap.dedent(
    """
    import time
    from pathlib import Path

    def hold(out):
        holding = Path(out).parent / "holding"
        holding.mkdir(exist_ok=True)
        start = time.time()
        (holding / Path(out).stem).touch()
        deadline = time.monotonic() + 60
        while len(list(holding.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        return start, time.time()
    """
)

HOLDER = HOLD + textwrap.dedent(
    """
    import json, os, sys
    from draftflow.gpus import claim_gpus
    count, out = int(sys.argv[1]), sys.argv[2]
    with claim_gpus(count) as ids:
        start, end = hold(out)
        cvd = os.environ["CUDA_VISIBLE_DEVICES"]
    json.dump({"ids": ids, "cvd": cvd, "start": start, "end": end, "count": count}, open(out, "w"))
    """
)

RECORDER = HOLD + textwrap.dedent(
    """
    import json, os, sys
    start, end = hold(sys.argv[2])
    ids = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    json.dump({"ids": ids, "cvd": os.environ["CUDA_VISIBLE_DEVICES"], "start": start, "end": end,
               "count": int(sys.argv[1])}, open(sys.argv[2], "w"))
    """
)


def test_concurrent_processes_get_disjoint_device_sets(tmp_path):
    """Eight jobs want 12 devices of 4 at once: the library and the CLI share the locks."""
    env = fake_env(tmp_path)
    counts = [1, 2, 1, 2, 2, 1, 2, 1]
    processes = []
    for i, count in enumerate(counts):
        out = tmp_path / f"job{i}.json"
        if i % 2:
            command = [PYTHON, "-c", HOLDER, str(count), str(out)]
        else:
            command = [PYTHON, "-m", "draftflow.gpus", "run", "-n", str(count), "--", PYTHON, "-c", RECORDER, str(count), str(out)]
        processes.append(subprocess.Popen(command, env=env, cwd=REPO))
    assert [process.wait(60) for process in processes] == [0] * len(counts)

    records = [json.loads((tmp_path / f"job{i}.json").read_text()) for i in range(len(counts))]
    for record in records:
        assert len(record["ids"]) == record["count"] and set(record["ids"]) <= {"0", "1", "2", "3"}
        assert record["cvd"] == ",".join(record["ids"])
    assert assert_disjoint_while_overlapping(records) > 0  # they did run side by side
    # never more than 4 devices in use at any moment
    for moment in sorted(r["start"] for r in records):
        assert sum(len(r["ids"]) for r in records if r["start"] <= moment < r["end"]) <= 4


def test_a_killed_job_gives_its_devices_back(tmp_path):
    env = fake_env(tmp_path, "0,1")
    holder = subprocess.Popen([PYTHON, "-m", "draftflow.gpus", "run", "-n", "2", "--", "sleep", "60"], env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 20
        while not all(gpus.holders(["0", "1"], tmp_path / "locks").values()):
            assert time.monotonic() < deadline, "the holder never took the devices"
            time.sleep(0.05)
        assert {h["pid"] for h in gpus.holders(["0", "1"], tmp_path / "locks").values()} == {holder.pid}
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        with gpus.claim_gpus(2, lock_dir=tmp_path / "locks", environ={"DRAFTFLOW_GPUS": "0,1"}, timeout_s=5) as ids:
            assert ids == ["0", "1"]
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


SNAKEFILE = HOLD + textwrap.dedent(
    """
    rule all:
        input: expand("out/{i}.json", i=range(6))

    rule use_gpus:
        output: "out/{i}.json"
        resources: gpu=lambda wildcards: 1 + int(wildcards.i) % 2
        run:
            import json, os
            from draftflow.gpus import claim_gpus
            with claim_gpus(resources.gpu) as ids:
                start, end = hold(output[0])
                cvd = os.environ["CUDA_VISIBLE_DEVICES"]
            json.dump({"ids": ids, "cvd": cvd, "start": start, "end": end, "count": resources.gpu}, open(output[0], "w"))
    """
)


def test_snakemake_jobs_under_a_gpu_cap_get_disjoint_devices(tmp_path):
    """Snakemake caps the GPU total at the device count; the helper places each job."""
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    env = {**fake_env(tmp_path, "0,1,2"), "PYTHONPATH": str(REPO)}
    process = subprocess.run(
        [str(SNAKEMAKE), "--workflow-profile", "none", "--cores", "6", "--resources", "gpu=3"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert process.returncode == 0, process.stderr[-4000:]
    records = [json.loads(path.read_text()) for path in sorted((tmp_path / "out").glob("*.json"))]
    assert len(records) == 6
    for record in records:
        assert len(record["ids"]) == record["count"] and record["cvd"] == ",".join(record["ids"])
    assert assert_disjoint_while_overlapping(records) > 0


# --- the local profile ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "environ", "local"),
    [
        (["-n"], {}, True),
        (["--cores", "2", "all"], {}, True),
        (["--profile", "profiles/default"], {}, True),
        (["--profile", "none"], {}, True),
        (["-e", "local"], {}, True),
        (["--executor", "dryrun"], {}, True),
        (["--profile", "profiles/slurm"], {}, False),
        (["--profile=profiles/kubernetes/config.yaml"], {}, False),
        (["--executor", "slurm"], {}, False),
        (["--executor=slurm"], {}, False),
        (["-eslurm"], {}, False),
        (["-n"], {"SNAKEMAKE_PROFILE": "profiles/slurm"}, False),
        (["--", "--profile", "x"], {}, True),
    ],
)
def test_snakemake_runs_locally_reads_the_command_line(argv, environ, local):
    assert job_placement.snakemake_runs_locally(argv, environ) is local


def render_default_profile(monkeypatch, argv, devices=None):
    monkeypatch.setattr(sys, "argv", ["snakemake", *argv])
    if devices is None:
        monkeypatch.delenv(gpus.ENV_DEVICES, raising=False)
    else:
        monkeypatch.setenv(gpus.ENV_DEVICES, devices)
    text = (REPO / "profiles/default/config.yaml").read_text()
    return yte.process_yaml(io.StringIO(text), require_use_yte=True)


def test_default_profile_caps_gpus_at_the_local_devices_only_for_local_runs(monkeypatch):
    local = render_default_profile(monkeypatch, ["-n"], "0,1,2")
    assert local["cores"] == "all"
    assert local["resources"]["gpu"] == 3
    assert local["resources"]["mem_mb"] == job_placement.local_memory_mb()
    assert render_default_profile(monkeypatch, [], "none")["resources"]["gpu"] == 0

    # beside a cluster profile, nothing of it may replace the cluster profile's keys
    cluster = render_default_profile(monkeypatch, ["--profile", "profiles/slurm"], "0,1,2")
    assert set(cluster) == {"printshellcmds", "rerun-incomplete", "show-failed-logs"}


def test_default_profile_sets_memory_for_every_rule(monkeypatch, tmp_path):
    local = render_default_profile(monkeypatch, ["-n"], "0")
    listed = snakemake(tmp_path, demo_config(), "--list-rules", "--workflow-profile", "none").stdout.split()
    rules = set(listed) - {"all"}
    assert rules <= set(local["set-resources"]), rules - set(local["set-resources"])
    assert all(set(res) == {"mem_mb"} for res in local["set-resources"].values())


@pytest.mark.parametrize(
    ("configured", "shards", "per_server", "local_gpus", "servers", "why"),
    [
        (None, 2, 0, 0, 1, "on CPU"),
        (None, 64, 8, 8, 1, "8 GPUs here, 8 per server"),
        (None, 16, 1, 8, 8, "8 GPUs here, 1 per server"),
        (None, 4, 1, 8, 4, "8 GPUs here"),  # never more servers than shards
        (None, 64, 8, 0, 1, "0 GPUs here"),  # a dry run on a machine without GPUs
        (None, 64, 8, None, 64, "set extract.servers"),  # a cluster: one per shard
        (3, 64, 8, 8, 3, "set by extract.servers"),
    ],
)  # fmt: skip
def test_extraction_server_jobs_fit_the_gpus_and_never_exceed_the_shards(configured, shards, per_server, local_gpus, servers, why):
    count, reason = job_placement.concurrent_servers(configured, shards, per_server, local_gpus)
    assert count == servers and why in reason
