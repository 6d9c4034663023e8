"""The workflow on a real SLURM cluster through Snakemake's executor plugin.

The cluster is Debian's slurm-wlm on this machine, one node, brought up and
torn down by .ci/slurm.sh (munge, a private MariaDB with slurmdbd so that sacct
works, slurmctld, slurmd; the node has two fake GPUs as GRES). The tests skip,
saying why, only where the machine cannot run it (not Linux, not root, no
apt-get, or a SLURM configuration of its own); with CI set they fail instead.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
import textwrap
import time
from itertools import combinations
from pathlib import Path

import pytest
import yaml

from draftflow import run_folder
from draftflow.answers import job_record
from draftflow.io import iter_jsonl
from tests.conftest import REPO, SNAKEMAKE, copy_demo_run, demo_config, snakemake

SLURM_SH = REPO / ".ci/slurm.sh"
PROFILE = REPO / "profiles/slurm"
FILL_INS = ("FILL_IN_PARTITION", "FILL_IN_ACCOUNT", "FILL_IN_GPU_MODEL")
GPU_RULES = {"generate_server", "extract_server", "fidelity_reference", "fidelity", "serve_check", "train", "evaluate", "pilot"}
TIMINGS: dict[str, float] = {}

pytestmark = pytest.mark.slow


def unavailable_reason() -> str | None:
    """Why this machine cannot run the test cluster, or None."""
    if platform.system() != "Linux":
        return f"SLURM test cluster needs Linux, this is {platform.system()}"
    if os.geteuid() != 0:
        return "SLURM test cluster needs root (it starts munged, slurmctld, slurmd and writes /etc/slurm)"
    have_daemons = all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd"))
    if not have_daemons and not shutil.which("apt-get"):
        return "slurm-wlm, slurmdbd, munge and mariadb-server are missing and there is no apt-get to install them"
    for name in ("slurm.conf", "slurmdbd.conf", "gres.conf"):
        path = Path("/etc/slurm") / name
        if path.is_symlink() and not path.exists():
            continue  # a crashed run's dangling link: slurm.sh replaces it
        if path.exists() and not (path.is_symlink() and "draftflow-slurm" in os.readlink(path)):
            return f"{path} exists: this machine has a SLURM configuration of its own, which the test leaves alone"
    return None


def run(command, timeout=600, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)


@pytest.fixture(scope="module")
def slurm_cluster():
    """A running single-node cluster: {'partition', 'account', 'gpus', 'dir', ...}."""
    reason = unavailable_reason()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the SLURM tests: {reason}")
        pytest.skip(reason)
    started = time.monotonic()
    install = run(["bash", str(SLURM_SH), "install"])
    assert install.returncode == 0, f"installing SLURM failed:\n{install.stderr[-4000:]}"
    TIMINGS["install_s"] = time.monotonic() - started

    state = Path(tempfile.mkdtemp(prefix="draftflow-slurm-", dir="/tmp"))
    try:
        started = time.monotonic()
        up = run(["bash", str(SLURM_SH), "up", str(state)], timeout=300)
        TIMINGS["bring_up_s"] = time.monotonic() - started
        assert up.returncode == 0, f"starting SLURM failed:\n{up.stderr[-4000:]}"
        info = dict(line.split("=", 1) for line in up.stdout.split() if "=" in line)
        yield info
    finally:
        started = time.monotonic()
        down = run(["bash", str(SLURM_SH), "down", str(state)], timeout=120)
        TIMINGS["tear_down_s"] = time.monotonic() - started
        print(f"\nSLURM test cluster timings: {json.dumps({k: round(v, 1) for k, v in TIMINGS.items()})}")
        leftovers = [p for p in ("slurm.conf", "slurmdbd.conf", "gres.conf") if os.path.lexists(f"/etc/slurm/{p}")]
        shutil.rmtree(state, ignore_errors=True)
        assert down.returncode == 0, down.stderr[-2000:]
        assert not leftovers, f"/etc/slurm still holds {leftovers}"


def filled_profile(directory: Path, cluster: dict) -> Path:
    """profiles/slurm with the three values a user fills in, as docs/clusters.md says."""
    text = (PROFILE / "config.yaml").read_text()
    for marker, value in zip(FILL_INS, (cluster["partition"], cluster["account"], ""), strict=True):
        assert text.count(f'"{marker}"') == 1, marker
        text = text.replace(f'"{marker}"', f'"{value}"')
    profile = directory / "profile"
    shutil.copytree(PROFILE, profile)
    (profile / "config.yaml").write_text(text)
    return profile


def submitted_jobs(log: str) -> tuple[str, list[str]]:
    run_id = re.search(r"SLURM run ID: (\S+)", log)
    assert run_id, "the executor plugin did not start"
    return run_id.group(1), re.findall(r"submitted with SLURM jobid (\d+)", log)


ACCOUNTING = "JobID,JobName,State,ExitCode,Account,Partition,AllocTRES"


def accounting(job_ids: list[str], fields=ACCOUNTING) -> list[dict]:
    """sacct's records of the jobs, once slurmdbd has them all as finished."""
    names = fields.split(",")
    deadline = time.monotonic() + 60
    while True:
        out = run(["sacct", "-X", "-P", "-n", "-j", ",".join(job_ids), "-o", fields], timeout=30)
        assert out.returncode == 0, out.stderr
        rows = [dict(zip(names, line.split("|"), strict=True)) for line in out.stdout.splitlines() if line]
        if len(rows) == len(job_ids) and all(row["State"] not in ("PENDING", "RUNNING") for row in rows):
            return rows
        assert time.monotonic() < deadline, f"sacct never listed the finished jobs: {rows}"
        time.sleep(1)


def write_prompts(path: Path) -> None:
    """Thirty conversations in both formats, with duplicates and system turns."""
    rows = []
    for i in range(26):
        question = f"What does `json.dumps` do with option {i}?"
        if i % 2:
            rows.append({"id": f"q{i}", "messages": [{"role": "user", "content": question}]})
        else:
            rows.append({"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": question}]})
    rows += rows[:4]  # duplicates
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


PROMPT_OUTPUTS = ("results/slurm/prompts/conversations.jsonl", "results/slurm/prompts/stats.json")
GENERATED = "results/slurm/synthetic/generated.jsonl"


def test_workflow_runs_through_slurm_and_matches_a_local_run(slurm_cluster, tmp_path, demo_run):
    """The prompts job, then generation in two jobs (generate.servers: 2), each with its
    own vLLM server, and the gather after both: each a SLURM job with the profile's
    resources. The prompts match a local run's; the answers are each conversation's."""
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts)
    # the demo target gives these out-of-domain prompts few answers: flawed, and not this test's point
    generate = {"servers": 2, "max_degenerate_fraction": 1.0}
    config = demo_config(False, run="slurm", data={"prompt_files": [str(prompts)], "num_samples": 20}, generate=generate)
    config_path = tmp_path / "config-slurm.yaml"
    config_path.write_text(yaml.safe_dump(config))
    common = [str(SNAKEMAKE), "--snakefile", str(REPO / "Snakefile"), "--configfile", str(config_path)]

    on_slurm = tmp_path / "slurm"
    copy_demo_run(demo_run, on_slurm)  # the demo's target, built once for the session
    started = time.monotonic()
    process = run(
        [*common, "--directory", str(on_slurm), "--profile", str(filled_profile(tmp_path, slurm_cluster)),
         "--slurm-init-seconds-before-status-checks", "1", *PROMPT_OUTPUTS, GENERATED],
        cwd=REPO,
    )  # fmt: skip
    TIMINGS["slurm_run_s"] = time.monotonic() - started
    assert process.returncode == 0, process.stderr[-6000:]
    run_id, job_ids = submitted_jobs(process.stderr)
    assert len(job_ids) == 4  # prompts, two generation jobs, the gather; nothing ran on the submit host

    # the scheduler's own records: each job ran under SLURM, charged to the profile's account
    rules = dict(re.findall(r"submitted with SLURM jobid (\d+) \(log: \S*?/rule_(\w+)/", process.stderr))
    jobs: dict[str, list[dict]] = {}
    for row in accounting(job_ids, f"{ACCOUNTING},Start,End"):
        jobs.setdefault(rules[row["JobID"]], []).append(row)
        assert row["JobName"] == run_id
        assert (row["State"], row["ExitCode"]) == ("COMPLETED", "0:0"), row
        assert (row["Account"], row["Partition"]) == (slurm_cluster["account"], slurm_cluster["partition"])
    assert {rule: len(rows) for rule, rows in jobs.items()} == {"prompts": 1, "generate_server": 2, "generate": 1}
    profile = yaml.safe_load((PROFILE / "config.yaml").read_text())["set-resources"]
    (prompts_job,), (gather,), servers = jobs["prompts"], jobs["generate"], jobs["generate_server"]
    assert f"mem={profile['prompts']['mem_mb']}M" in prompts_job["AllocTRES"]
    assert f"mem={profile['generate']['mem_mb']}M" in gather["AllocTRES"]
    for row in servers:  # device: cpu, so no GPU: one task's CPU and its memory per CPU
        assert f"mem={profile['generate_server']['mem_mb_per_cpu']}M" in row["AllocTRES"] and "gpu" not in row["AllocTRES"]
    assert gather["Start"] >= max(row["End"] for row in servers)  # ISO times: the gather after both
    results = on_slurm / "results/slurm"
    asked = [row["id"] for row in iter_jsonl(results / "prompts/conversations.jsonl")]
    answered = [row["primary_id"] for row in iter_jsonl(results / "synthetic/generated.jsonl")]
    records = [json.loads(Path(job_record(results / "synthetic", s)).read_text()) for s in (0, 1)]
    assert sorted(answered) == sorted(asked) and all(record["conversations_asked"] > 0 for record in records)
    assert sum(record["conversations"] for record in records) == len(asked) == 20

    local = tmp_path / "local"
    started = time.monotonic()
    process = run([*common, "--directory", str(local), "--cores", "2", *PROMPT_OUTPUTS], cwd=REPO)
    TIMINGS["local_run_s"] = time.monotonic() - started
    assert process.returncode == 0, process.stderr[-6000:]
    assert "SLURM run ID" not in process.stderr

    for output in PROMPT_OUTPUTS:
        assert (on_slurm / output).read_bytes() == (local / output).read_bytes(), output
    assert len((local / PROMPT_OUTPUTS[0]).read_text().splitlines()) == 20
    assert (on_slurm / run_folder.benchmark_path("slurm", "prompts")).exists()


GPU_SNAKEFILE = textwrap.dedent(
    """
    rule all:
        input: expand("out/{i}.json", i=range(3))

    rule use_gpu:
        output: "out/{i}.json"
        resources: gpu=1
        run:
            import json, os, time
            from draftflow.gpus import claim_gpus
            assigned = os.environ.get("CUDA_VISIBLE_DEVICES")
            with claim_gpus(resources.gpu) as ids:
                start = time.time(); time.sleep(4); end = time.time()
                cvd = os.environ["CUDA_VISIBLE_DEVICES"]
            json.dump({"assigned": assigned, "ids": ids, "cvd": cvd, "start": start, "end": end,
                       "job": os.environ["SLURM_JOB_ID"]}, open(output[0], "w"))
    """
)


def test_gpu_jobs_use_the_devices_slurm_assigned(slurm_cluster, tmp_path):
    """Three 1-GPU jobs on a 2-GPU node: sbatch --gpus=1, and claim_gpus keeps SLURM's choice."""
    (tmp_path / "Snakefile").write_text(GPU_SNAKEFILE)
    env = {**os.environ, "PYTHONPATH": str(REPO), "DRAFTFLOW_GPUS": "5,6,7"}  # exported into the jobs, and overruled
    env.pop("CUDA_VISIBLE_DEVICES", None)
    process = run(
        [str(SNAKEMAKE), "--workflow-profile", "none", "--executor", "slurm", "--jobs", "3",
         "--default-resources", f"slurm_partition={slurm_cluster['partition']}",
         f"slurm_account={slurm_cluster['account']}", "mem_mb=1000",
         "--slurm-init-seconds-before-status-checks", "1"],
        cwd=tmp_path, env=env,
    )  # fmt: skip
    assert process.returncode == 0, process.stderr[-6000:]
    _, job_ids = submitted_jobs(process.stderr)
    assert len(job_ids) == 3
    for row in accounting(job_ids):
        assert row["State"] == "COMPLETED" and "gres/gpu=1" in row["AllocTRES"], row

    records = [json.loads(path.read_text()) for path in sorted((tmp_path / "out").glob("*.json"))]
    fake_gpus = {str(i) for i in range(int(slurm_cluster["gpus"]))}
    for record in records:
        assert record["ids"] == [record["assigned"]] and record["cvd"] == record["assigned"], record
        assert record["assigned"] in fake_gpus
    for a, b in combinations(records, 2):
        if a["start"] < b["end"] and b["start"] < a["end"]:
            assert a["ids"] != b["ids"], (a, b)


# --- the profiles, without a cluster ------------------------------------------------------


def test_the_cluster_is_skipped_only_with_a_reason(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in unavailable_reason()
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    assert "needs Linux" in unavailable_reason()


def test_slurm_profile_leaves_exactly_partition_account_and_gpu_model_to_fill_in():
    text = (PROFILE / "config.yaml").read_text()
    assert sorted(set(re.findall(r"FILL_IN_\w+", text))) == sorted(FILL_INS)
    profile = yaml.safe_load(text)
    assert profile["executor"] == "slurm"
    assert {"jobs", "latency-wait", "retries"} <= set(profile)
    defaults = profile["default-resources"]
    assert (defaults["slurm_partition"], defaults["slurm_account"]) == FILL_INS[:2]
    resources = profile["set-resources"]
    for rule, values in resources.items():
        assert "gpu" not in values, f"{rule}: GPU counts come from the config, not the profile"
        if rule in GPU_RULES:
            assert values["gpu_model"] == "FILL_IN_GPU_MODEL"
            assert {"cpus_per_gpu", "mem_mb_per_cpu", "runtime"} <= set(values), rule
        else:
            assert not {"gpu_model", "cpus_per_gpu"} & set(values), rule
            assert {"mem_mb", "runtime"} <= set(values), rule
    assert GPU_RULES <= set(resources)


def test_every_rule_that_runs_on_a_compute_node_has_slurm_resources(tmp_path):
    listed = snakemake(tmp_path, demo_config(), "--list-rules", "--workflow-profile", "none")
    rules = set(listed.stdout.split()) - {"all"}
    local = set()
    for smk in (REPO / "rules").glob("*.smk"):
        for block in re.findall(r"^localrules:\n((?:[ \t]+\w+,?\n)+)", smk.read_text(), re.MULTILINE):
            local |= set(re.findall(r"\w+", block))
    assert {"extract_plan", "extract", "train_views", "report", "provenance"} <= local
    resources = yaml.safe_load((PROFILE / "config.yaml").read_text())["set-resources"]
    assert rules - local <= set(resources), rules - local - set(resources)


def test_kubernetes_profile_names_the_gpu_resources_its_plugin_needs():
    profile = yaml.safe_load((REPO / "profiles/kubernetes/config.yaml").read_text())
    assert profile["executor"] == "kubernetes"
    # the plugin refuses any rule with a `gpu` resource (all GPU rules, also at 0) without it
    assert profile["default-resources"]["gpu_manufacturer"] == "nvidia"
    for rule in GPU_RULES:
        assert profile["set-resources"][rule]["machine_type"]


def example_8gpu(tmp_path: Path) -> Path:
    """config/examples/moe-1t-8gpu.yaml with its weights and prompts pointed at stand-ins."""
    config = yaml.safe_load((REPO / "config/examples/moe-1t-8gpu.yaml").read_text())
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 61, "vocab_size": 163840}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    config["target"]["path"] = str(target)
    config["data"]["prompt_files"] = [str(prompts)]
    path = tmp_path / "moe-1t-8gpu.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def dry_run_resources(output: str) -> dict[str, list[dict[str, str]]]:
    """rule -> the resources of each of its jobs, from `snakemake -n` output."""
    jobs: dict[str, list[dict[str, str]]] = {}
    for block in re.split(r"\n(?=\[[^\n]*\]\n(?:local)?rule )", output):
        name = re.search(r"^(?:local)?rule (\w+):", block, re.MULTILINE)
        resources = re.search(r"^\s+resources: (.*)$", block, re.MULTILINE)
        if name and resources:
            pairs = dict(item.split("=", 1) for item in resources.group(1).split(", "))
            jobs.setdefault(name.group(1), []).append(pairs)
    return jobs


def test_dry_run_with_the_slurm_profile_shows_gpu_counts_per_rule(tmp_path):
    """The 8-GPU example: vLLM servers take tensor parallel x data parallel GPUs, training
    train.gpus, the fidelity reference transformers' one and the evaluation one, the fidelity
    comparison (vLLM's states from the files) none."""
    config = example_8gpu(tmp_path)
    process = run(
        [str(SNAKEMAKE), "-n", "--profile", str(PROFILE), "--snakefile", str(REPO / "Snakefile"),
         "--directory", str(tmp_path), "--configfile", str(config)],
        cwd=REPO, timeout=300,
    )  # fmt: skip
    assert process.returncode == 0, process.stderr[-4000:]
    output = process.stdout + process.stderr
    assert "workflow specific profile" in output  # profiles/default was applied too, and stepped aside
    jobs = dry_run_resources(output)
    settings = yaml.safe_load(config.read_text())
    server_gpus = settings["vllm"]["tensor_parallel_size"] * settings["vllm"].get("data_parallel_size", 1)
    expected = {"generate_server": server_gpus, "extract_server": server_gpus, "train": settings["train"]["gpus"]}
    if "serve_check" in jobs:
        expected["serve_check"] = server_gpus
    # a cluster's GPU count is unknown to the workflow: one server job per shard unless extract.servers says
    assert len(jobs["extract_server"]) == settings["extract"]["shards"]
    for rule, resources in jobs.items():
        for job in resources:
            assert job["slurm_partition"] == "FILL_IN_PARTITION"
            if rule in expected:
                assert int(job["gpu"]) == expected[rule] == 8, (rule, job)
                assert (job["gpu_model"], job["cpus_per_gpu"]) == ("FILL_IN_GPU_MODEL", "8")
            elif rule in ("fidelity_reference", "evaluate"):
                assert int(job["gpu"]) == 1, job
            else:
                assert int(job.get("gpu", 0)) == 0, (rule, job)
    assert settings["extract"].get("backend", "vllm") == "vllm"  # so fidelity asks for none
    assert set(expected) | {"fidelity_reference", "fidelity"} <= set(jobs)
