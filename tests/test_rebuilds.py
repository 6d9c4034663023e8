"""Partial rebuilds: an edit reruns exactly the stages that depend on it, as
draftflow.dependencies says (docs/rebuilds.md's table)."""

import json
import re
import shutil
from pathlib import Path

import pytest
from datasets import load_from_disk
from safetensors import safe_open

from draftflow.dependencies import reruns
from draftflow.extract import layout
from draftflow.extract.shards import remove_stale_shards
from draftflow.vllm_server import START_MARKER
from tests.conftest import REPO, copy_demo_run, demo_config, plan_before_running, snakemake, workflow_copy

pytestmark = pytest.mark.slow

FROM_GENERATE = {
    "generate_server", "generate", "prepare", "vocab_map", "extract_plan", "fidelity_reference", "extract_server", "extract",
    "fidelity", "drafter_init", "train_views", "train", "evaluate", "serve_check", "report", "provenance", "model_card",
}  # fmt: skip
NOT_IN_THE_DEMO = {"pilot"}  # pilot.enabled is false in the demo: the edits that would rerun it run none


def planned_jobs(workdir: Path, config: dict, workflow: Path = REPO) -> dict[str, int]:
    """Rule -> jobs, from the `Job stats` table of `snakemake -n` (the `all` target left out)."""
    output = snakemake(workdir, config, "-n", workflow=workflow).stdout
    if "Nothing to be done" in output:
        return {}
    table = output.split("Job stats:", 1)[1].split("\n\n", 1)[0]
    jobs = {name: int(count) for name, count in re.findall(r"^(\w+)\s+(\d+)$", table, flags=re.MULTILINE)}
    return {name: count for name, count in jobs.items() if name not in ("all", "total")}


def planned_rules(workdir: Path, config: dict, workflow: Path = REPO) -> set[str]:
    return set(planned_jobs(workdir, config, workflow))


@pytest.fixture(scope="module")
def settled(workdir, demo_run):
    """The demo, untouched by the tests before: every output up to date."""
    assert planned_rules(workdir, demo_config()) == set()
    return workdir


EDITED_VALUES = {
    "train.lr": 0.001, "train.epochs": 9, "train.ttt_steps": 4, "vocab.draft_vocab_size": 64,
    "extract.layer_ids": [1, 3, 5], "evaluate.min_acceptance_length": 1.5, "extract.fidelity": "never",
    "generate.temperature": 0.5,
}  # fmt: skip


@pytest.mark.parametrize("key", EDITED_VALUES)
def test_config_edit_reruns_exactly_its_stages(settled, key):
    """The stages draftflow.dependencies says the key reruns, against Snakemake's job table."""
    section, name = key.split(".")
    jobs = planned_jobs(settled, demo_config(**{section: {name: EDITED_VALUES[key]}}))
    assert set(jobs) == set(reruns((key,))) - NOT_IN_THE_DEMO
    if "extract_server" in jobs:  # "(all)": every server job, each redoing all of its shards
        assert jobs["extract_server"] == json.loads((settled / "results/demo/hidden_states/plan.json").read_text())["servers"]


def test_new_prompt_file_reruns_everything(settled):
    extra = settled / "more-prompts.jsonl"
    extra.write_text('{"id": "new-1", "messages": [{"role": "user", "content": "Explain `os.sep`."}]}\n')
    files = demo_config()["data"]["prompt_files"] + [str(extra)]
    assert planned_rules(settled, demo_config(data={"prompt_files": files})) == {"prompts"} | FROM_GENERATE
    assert {"prompts"} | FROM_GENERATE == set(reruns(("data.prompt_files",))) - NOT_IN_THE_DEMO


def test_editing_training_code_reruns_training_not_generation(settled, tmp_path):
    workflow = workflow_copy(tmp_path)
    # the same code in another folder: nothing (provenance records the commit, not the folder)
    assert planned_rules(settled, demo_config(), workflow) == set()
    with (workflow / "draftflow/train.py").open("a") as module:
        module.write("\n# an edit\n")
    planned = planned_rules(settled, demo_config(), workflow)
    assert planned == {"drafter_init", "train", "evaluate", "serve_check", "report", "provenance", "model_card"}


# Modules the extraction jobs run that no literal import of the script names: the
# connector vLLM's server loads by its module path, a module imported from its
# package (`from draftflow.extract import layout`), the package's __init__.
EXTRACTION_MODULES_REACHED_BY_NAME = ("extract/vllm_connector.py", "extract/layout.py", "extract/__init__.py")


def test_editing_a_module_the_extraction_jobs_run_reruns_them_and_one_no_rule_runs_reruns_nothing(settled, tmp_path):
    workflow = workflow_copy(tmp_path)
    for module in (*EXTRACTION_MODULES_REACHED_BY_NAME, "extract/shards.py"):
        path = workflow / "draftflow" / module
        unedited = path.read_bytes()
        path.write_bytes(unedited + b"\n# an edit\n")
        planned = planned_rules(settled, demo_config(), workflow)
        assert {"extract_server", "fidelity"} <= planned and not {"generate_server", "generate"} & planned, module
        path.write_bytes(unedited)
    with (workflow / "draftflow/locks.py").open("a") as module:  # the lock files' generator: no job runs it
        module.write("\n# an edit\n")
    assert planned_rules(settled, demo_config(), workflow) == set()  # as unedited


def test_editing_the_demos_builder_rebuilds_the_demo_target(settled, tmp_path):
    """The demo's builders live outside draftflow (demo/); their rule's version follows them."""
    workflow = workflow_copy(tmp_path)
    with (workflow / "demo/target.py").open("a") as module:
        module.write("\n# an edit\n")
    assert "demo_target" in planned_rules(settled, demo_config(), workflow)


def reversed_keys(value):
    return {k: reversed_keys(v) for k, v in reversed(value.items())} if isinstance(value, dict) else value


def test_the_config_keys_in_another_order_rerun_nothing(settled):
    output = snakemake(settled, reversed_keys(demo_config()), "-n", sort_keys=False).stdout
    assert "Nothing to be done" in output, output[-3000:]


def test_changing_shard_count_reruns_the_extraction_jobs_not_generation(settled):
    jobs = planned_jobs(settled, demo_config(extract={"shards": 3}))
    assert {"extract_plan": 1, "extract_server": 1, "extract": 1}.items() <= jobs.items() and not {"generate_server", "generate"} & set(jobs)


def test_extract_plan_removes_the_shards_beyond_a_lower_count_and_names_them(tmp_path, demo_run):
    results = copy_demo_run(demo_run, tmp_path, "prompts", "synthetic", "prepared", "hidden_states")
    snakemake(tmp_path, demo_config(extract={"shards": 1}), "results/demo/hidden_states/plan.json", "--forcerun", "extract_plan")
    log = (tmp_path / "logs/demo/extract_plan.log").read_text()
    assert "1 shards on 1 server jobs now: removed stale ['shard-1', 'shard-1.heartbeat.json', 'shard-1.json']" in log
    assert not (results / "hidden_states/shard-1").exists() and (results / "hidden_states/shard-0").is_dir()


def test_fewer_shards_remove_the_stale_ones(tmp_path):
    for k in range(4):
        (tmp_path / f"shard-{k}").mkdir()
        (tmp_path / f"shard-{k}" / "hs_0.safetensors").write_bytes(b"x")
        (tmp_path / f"shard-{k}.json").write_text("{}")
        (tmp_path / f"shard-{k}.heartbeat.json").write_text("{}")
        (tmp_path / f"server-{k}.json").write_text("{}")
    removed = remove_stale_shards(tmp_path, 2, 1)
    stale = [f"shard-{k}{s}" for k in (2, 3) for s in ("", ".json", ".heartbeat.json")]
    assert sorted(removed) == sorted(stale + ["server-1.json", "server-2.json", "server-3.json"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"shard-{k}{s}" for k in (0, 1) for s in ("", ".json", ".heartbeat.json")] + ["server-0.json"]
    )


def test_changing_the_server_count_reruns_the_server_jobs_which_load_nothing(tmp_path, demo_run):
    """The shards are complete: each new server job finds its shard's journal full and starts no server."""
    results = copy_demo_run(demo_run, tmp_path, "prompts", "synthetic", "prepared", "hidden_states")
    files = {path: path.stat().st_mtime_ns for path in (results / "hidden_states").glob("shard-*/hs_*.safetensors")}
    config = demo_config(extract={"servers": 2})
    snakemake(tmp_path, config, "results/demo/hidden_states/manifest.json", "--forcerun", "extract_plan")
    for server in (0, 1):
        log = (tmp_path / f"logs/demo/extract_server-{server}.log").read_text()
        shard = json.loads((results / f"hidden_states/shard-{server}.json").read_text())
        assert f"shard {server}: {len(shard['files'])} of {len(shard['files'])} samples already on disk" in log
        assert json.loads((results / f"hidden_states/shard-{server}.heartbeat.json").read_text())["loads_model"] is False
        server_log = tmp_path / f"logs/demo/extract_server-{server}.server.log"
        assert not server_log.exists() or START_MARKER not in server_log.read_text()  # no server started
    assert {path: path.stat().st_mtime_ns for path in files} == files


def test_a_new_fidelity_tolerance_reruns_the_comparison_and_leaves_the_reference_and_the_extraction(tmp_path, demo_run):
    """docs/rebuilds.md's claim, by the files a real rerun leaves: the demo with its records
    (.snakemake/metadata) copied, its tolerance doubled, run to the end."""
    workdir = demo_run.parents[1]
    for part in ("resources", "results/demo", "benchmarks/demo", "logs/demo", ".snakemake/metadata"):
        shutil.copytree(workdir / part, tmp_path / part, symlinks=True)
    results = tmp_path / "results/demo"
    kept = [results / "fidelity/reference.json", results / "fidelity/reference.safetensors",
            results / "hidden_states/manifest.json", results / "train/stats.json"]  # fmt: skip
    before = {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in kept}
    tolerance = json.loads((results / "fidelity/fidelity.json").read_text())["tolerance"] * 2
    snakemake(tmp_path, demo_config(extract={"fidelity_tolerance": {"float32": tolerance}}))
    fidelity = json.loads((results / "fidelity/fidelity.json").read_text())
    assert fidelity["tolerance"] == tolerance and fidelity["passed"]
    assert {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in kept} == before


def test_editing_the_connector_extracts_every_sample_again_and_asks_nothing(tmp_path, demo_run):
    """docs/rebuilds.md's row, by the files a real rerun leaves: the demo with its records
    (.snakemake/metadata) copied, run up to the extraction's manifest by a copy of the
    workflow whose vLLM connector (the module vLLM's server loads) is edited."""
    run, workflow = tmp_path / "run", tmp_path / "workflow"
    for part in ("resources", "results/demo", "benchmarks/demo", ".snakemake/metadata"):
        shutil.copytree(demo_run.parents[1] / part, run / part, symlinks=True)
    workflow.mkdir()
    connector = workflow_copy(workflow) / "draftflow/extract/vllm_connector.py"
    connector.write_text(connector.read_text() + "\n# an edit\n")
    results = run / "results/demo"
    files = {path: path.stat().st_mtime_ns for path in layout.hidden_state_files(results / "hidden_states")}
    kept = [results / name for name in ("prompts/conversations.jsonl", "synthetic/generated.jsonl", "prepared/stats.json")]
    before = {path: path.stat().st_mtime_ns for path in kept}
    before_running = plan_before_running(run, demo_config(), workflow)  # python -m draftflow.plan
    snakemake(run, demo_config(), "results/demo/hidden_states/manifest.json", workflow=workflow)
    for plan in (before_running, json.loads((results / "run_plan.json").read_text())):
        stages = {stage["name"]: stage for stage in plan["stages"]}
        assert stages["generate_server"]["computed"] == 0 and stages["generate_server"]["model_loads"] == 0
        assert (stages["extract_server"]["reused"], stages["extract_server"]["computed"]) == (0, len(files))
        assert stages["extract_server"]["seconds"] > 0  # the hours it costs
    now = {path: path.stat().st_mtime_ns for path in layout.hidden_state_files(results / "hidden_states")}
    assert set(now) == set(files) and all(now[path] != mtime for path, mtime in files.items())
    assert {path: path.stat().st_mtime_ns for path in kept} == before
    assert not (run / "logs/demo/generate_server-0.log").exists() and not (run / "logs/demo/prepare.log").exists()
    rows = load_from_disk(str(results / "prepared/dataset")).with_format(None)
    for sample_id, token_ids in zip(rows["sample_id"], rows["input_ids"], strict=True):
        shard = layout.shard_of(sample_id, demo_config()["extract"]["shards"])
        with safe_open(str(layout.shard_dir(results / "hidden_states", shard) / layout.file_name(sample_id)), "pt") as states:
            assert states.get_tensor("token_ids").tolist() == token_ids, sample_id
