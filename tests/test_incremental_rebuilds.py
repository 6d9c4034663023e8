"""Partial rebuilds reuse a sample's work only for that sample (issue 22).

A tiny target (the Qwen3-MoE twin) answers a start config; edits follow it: more
samples, a prompt file added and two questions of another edited in place, another
temperature, a shorter ``prepare.max_seq_length`` (each also run in a fresh folder:
clean); fewer samples, from the clean run of more back to the start config (the start
run is its clean run); and edits of what the data is made with (issue 42): the target's
``chat_template.jinja`` edited, ``--chat-template`` added to ``vllm.extra_args``,
one tensor of the target's weight file edited in place (issue 60: one norm
scaled, the file saved over the old one, its size unchanged). Each edit runs on a
copy of an earlier run's folder (the start's, or for fewer samples the clean run of
more) with its Snakemake records (incremental: what a user's second run does); the
target is a folder inside it (``target.path: target``), edited in place there, so the
copy is also a moved run and target.
The tests open the files the runs leave: the hidden states that training and
evaluation read hold their rows' tokens; generation asked, and extraction
computed, exactly the conversations and samples the edit made new; and the
incremental run's files are the clean run's, byte for byte. The edits touch the
stages up to the training views; one of them (more samples) runs on through
training and evaluation, to show that the same views train the same drafter.

Every run generates through a vLLM server of the module (``generate.endpoint``,
started with the flags the workflow gives its own), so its request counter says
exactly what each run asked, and no run pays a server start; the template edits
ask a second one, which renders with the edited template. Generation asks one
conversation at a time and extraction (the transformers backend) computes one
sample at a time, so that no answer or state depends on which others shared its
batch: a clean run and an incremental run batch differently by design.
"""

from __future__ import annotations

import json
import re
import shutil
import urllib.request
from pathlib import Path

import pytest
from datasets import load_from_disk
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftflow import run_folder
from draftflow.config import load_config
from draftflow.extract import layout
from draftflow.io import iter_jsonl, write_jsonl
from draftflow.plan import build_plan, rates_from_run
from draftflow.report import read_benchmark
from draftflow.run_folder import STAGE
from draftflow.vllm_server import server_env, target_server_args, vllm_server
from tests.compare import assert_same_files
from tests.conftest import config_file, demo_config, plan_before_running, snakemake
from tests.twins import build_twin, edit_one_tensor

pytestmark = pytest.mark.slow

MODULES = (
    "os", "json", "re", "math", "itertools", "functools", "collections", "pathlib", "shutil", "heapq",
    "bisect", "textwrap", "datetime", "random", "statistics", "string", "struct", "zlib", "hashlib", "base64",
    "csv", "argparse", "logging", "threading", "queue", "contextlib", "dataclasses", "enum", "typing", "operator",
)  # fmt: skip
RUN = "edit"
# What the runs build: up to the training views (what an edit of the data changes), or on
# to the evaluation (fidelity, the report and provenance record nothing the comparison
# looks at).
EVALUATION, VIEWS = f"results/{RUN}/evaluation/evaluation.json", f"results/{RUN}/training_data/split.json"
VIEW_STAGES = ("prompts", "synthetic", "prepared", "hidden_states", "training_data")  # the stage folders a run to VIEWS makes
PROMPTS, MORE_PROMPTS = "prompts.jsonl", "more-prompts.jsonl"  # in each run's folder, as a user keeps them
TARGET = "target"  # in each run's folder too: an edit of the target is made in place, in the copy
TEMPLATE = "brief.jinja"  # the edited chat template, for --chat-template
EDITS = ("num_samples_grown", "num_samples_shrunk", "prompt_files_edited", "temperature_changed",
         "max_seq_length_lowered")  # fmt: skip
# edits run on the clean run of another edit (incremental) and compared with the start run
# (clean): its config is theirs, which no second clean run would show more of
BACK_TO_START = {"num_samples_shrunk": "num_samples_grown"}
# edits of what the data is made with: checked for what they redo and for the files training
# would read (run up to the training views), not against a clean run
TARGET_EDITS = ("chat_template_edited", "chat_template_flag_added", "one_tensor_edited")
TEMPLATE_EDITS = ("chat_template_edited", "chat_template_flag_added")  # asked of the module's second server
EDITS_RUN_TO_EVALUATION = ("num_samples_grown",)  # the others stop at the training views
# edits after which generation answers every conversation again (another answer store)
NEW_ANSWER_STORE = ("temperature_changed", *TARGET_EDITS)


def questions(prefix: str, modules) -> list[dict]:
    return [
        {"id": f"{prefix}{i}", "messages": [{"role": "user", "content": f"What is the {m} module for, and when would you use it?"}]}
        for i, m in enumerate(modules)
    ]


def brief(template: str) -> str:
    """The chat template with a line before every prompt: every prompt renders otherwise."""
    return "Be brief.\n" + template


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Path:
    """The target, the target with the edited template, and two prompt files, shared by
    every run of the module."""
    lab = tmp_path_factory.mktemp("incremental")
    build_twin("qwen3_moe", lab / TARGET)
    shutil.copytree(lab / TARGET, lab / "templated-target")
    (lab / TEMPLATE).write_text(brief((lab / TARGET / "chat_template.jinja").read_text()))
    shutil.copy(lab / TEMPLATE, lab / "templated-target/chat_template.jinja")
    write_jsonl(lab / PROMPTS, questions("q", MODULES[:24]))
    write_jsonl(lab / MORE_PROMPTS, questions("r", MODULES[24:]))
    return lab


def new_folder(lab: Path, name: str) -> Path:
    """A run's own folder, with its own copy of the prompt files and the target."""
    folder = lab / name
    folder.mkdir()
    for prompts in (PROMPTS, MORE_PROMPTS):
        shutil.copy(lab / prompts, folder / prompts)
    shutil.copytree(lab / TARGET, folder / TARGET)
    return folder


def serve(lab: Path, target: str):
    """``lab/target`` served as the workflow serves it for generation; its base URL."""
    settings = config(lab, "unused")
    args = target_server_args(settings["vllm"], dtype="float32", device="cpu", seed=settings["seed"], trust_remote_code=False)
    env = server_env(settings["vllm"], "cpu")
    return vllm_server(str(lab / target), args, lab / f"{target}.server.log", health_timeout_s=600, env=env)


@pytest.fixture(scope="module")
def server(lab) -> str:
    with serve(lab, TARGET) as url:
        yield url


@pytest.fixture(scope="module")
def templated_server(lab) -> str:
    """The target with its template edited (TEMPLATE), as a user restarts their endpoint after the edit."""
    with serve(lab, "templated-target") as url:
        yield url


def requests_served(url: str) -> int:
    """vLLM's own count of the requests it finished."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as reply:
        lines = reply.read().decode().splitlines()
    return round(sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:request_success_total")))


def config(lab: Path, endpoint: str, **overrides) -> dict:
    base = demo_config(
        False,
        run=RUN,
        target={"path": TARGET},
        data={"prompt_files": [PROMPTS], "num_samples": 16},
        vllm={"max_model_len": 512},
        # the twin's answers run to the end of max_tokens: flawed by design; 32 of them and
        # a prompt of about 28 make a row, and the server answers one token after another
        generate={"max_tokens": 32, "concurrency": 1, "endpoint": endpoint, "max_degenerate_fraction": 1.0},
        prepare={"max_seq_length": 256},
        vocab={"draft_vocab_size": 64, "coverage_sizes": [16, 32, 64]},
        extract={"backend": "transformers", "token_budget": 1, "shards": 2, "layer_ids": [1, 2, 3], "fidelity": "never"},
        train={"epochs": 1, "heldout_fraction": 0.25},
        evaluate={"min_acceptance_length": 1.0, "serve_check": False},
    )
    for section, values in overrides.items():
        base[section] = {**base[section], **values}
    return base


@pytest.fixture(scope="module")
def start(lab, server) -> Path:
    """The start config, run once: the folder every incremental run copies."""
    folder = new_folder(lab, "start")
    snakemake(folder, config(lab, server), EVALUATION)
    return folder


def prepared_rows(folder: Path) -> dict[str, list[int]]:
    dataset = load_from_disk(str(folder / f"results/{RUN}/prepared/dataset")).with_format(None)
    return dict(zip(dataset["sample_id"], dataset["input_ids"], strict=True))


def edit_overrides(edit: str, lab: Path, start: Path) -> dict:
    """The config sections an edit changes (the shorter max_seq_length: the start's median row length)."""
    if edit == "num_samples_grown":
        return {"data": {"num_samples": 20}}
    if edit == "prompt_files_edited":
        return {"data": {"prompt_files": [PROMPTS, MORE_PROMPTS]}}
    if edit == "temperature_changed":
        return {"generate": {"temperature": 0.8}}
    if edit in ("num_samples_shrunk", "chat_template_edited", "one_tensor_edited"):  # shrunk: the start's 16, from 20
        return {}
    if edit == "chat_template_flag_added":
        return {"vllm": {"extra_args": ["--chat-template", str(lab / TEMPLATE)]}}
    lengths = sorted(len(ids) for ids in prepared_rows(start).values())
    return {"prepare": {"max_seq_length": lengths[len(lengths) // 2]}}  # cuts about half of the rows


@pytest.fixture(scope="module")
def edit_runs(lab, server, start, request):
    """Each edit, run once when a test first asks for it: on a copy of the start's folder
    (or BACK_TO_START's) (incremental) and, for EDITS, in a fresh folder (clean; the start
    for BACK_TO_START)."""
    done = {}

    def run(edit: str) -> dict:
        if edit not in done:
            url = request.getfixturevalue("templated_server") if edit in TEMPLATE_EDITS else server
            if edit in BACK_TO_START:
                done[edit] = run_edit(edit, lab, url, start, before=run(BACK_TO_START[edit])["clean"], clean=start)
            else:
                done[edit] = run_edit(edit, lab, url, start, before=start, clean=None if edit in TARGET_EDITS else "new")
        return done[edit]

    return run


@pytest.fixture(params=EDITS)
def edited(request, edit_runs) -> dict:
    return edit_runs(request.param)


@pytest.fixture(params=EDITS + TARGET_EDITS)
def any_edit(request, edit_runs) -> dict:
    return edit_runs(request.param)


def edit_in_place(edit: str, lab: Path, folder: Path, start: Path) -> None:
    """What the edit changes in a run's folder besides its config: a prompt file, or the target."""
    if edit == "prompt_files_edited":
        edit_two_questions(folder / PROMPTS, EDITED_QUESTIONS)
    elif edit == "chat_template_edited":
        shutil.copy(lab / TEMPLATE, folder / TARGET / "chat_template.jinja")
    elif edit == "one_tensor_edited":  # a fix of one norm saved over the old file: names, shapes, dtypes kept
        edit_one_tensor(folder / TARGET / "model.safetensors", "model.layers.0.input_layernorm.weight")



def run_edit(edit: str, lab: Path, server: str, start: Path, before: Path, clean: Path | str | None) -> dict:
    """The edited config run incrementally on a copy of ``before``, and clean ("new": in a
    fresh folder; a folder: a run of that config already); the requests the incremental run made."""
    edited_config = config(lab, server, **edit_overrides(edit, lab, start))
    incremental = copy_of(before, lab / f"incremental-{edit}")
    edit_in_place(edit, lab, incremental, start)
    target = EVALUATION if edit in EDITS_RUN_TO_EVALUATION else VIEWS
    plan = plan_before_running(incremental, edited_config)
    served = requests_served(server)
    snakemake(incremental, edited_config, target)
    run = {"edit": edit, "config": edited_config, "incremental": incremental, "before": before, "clean": clean,
           "requests": requests_served(server) - served, "plan": plan}  # fmt: skip
    if clean == "new":
        run["clean"] = new_folder(lab, f"clean-{edit}")
        edit_in_place(edit, lab, run["clean"], start)
        snakemake(run["clean"], edited_config, target)
    return run


# two questions the start asks and the edited prompt files still draw (the sampling ranks each
# question by the seed and its content: draftflow.prompts.lowest_ranked)
EDITED_QUESTIONS = ("q0", "q5")


def edit_two_questions(prompts: Path, ids: tuple[str, ...]) -> None:
    """Questions with other words under the same ids, as a user fixes a prompt file in place."""
    rows = list(iter_jsonl(prompts))
    for row in rows:
        if row["id"] in ids:
            row["messages"][0]["content"] += " Give one example."
    write_jsonl(prompts, rows)


def results(folder: Path) -> Path:
    return folder / f"results/{RUN}"


def log(folder: Path, rule: str) -> str:
    return (folder / f"logs/{RUN}/{rule}.log").read_text()


def test_every_file_training_and_evaluation_read_holds_its_rows_tokens(any_edit):
    run = any_edit["incremental"]
    rows = prepared_rows(run)
    seen = set()
    for view in ("train", "heldout"):
        dataset = load_from_disk(str(results(run) / "training_data" / view)).with_format(None)
        for row, (sample_id, token_ids) in enumerate(zip(dataset["sample_id"], dataset["input_ids"], strict=True)):
            assert rows[sample_id] == token_ids, sample_id
            with safe_open(str(results(run) / "training_data" / view / f"hidden_states/hs_{row}.safetensors"), "pt") as f:
                assert f.get_tensor("token_ids").tolist() == token_ids, (view, row, sample_id)
            seen.add(sample_id)
    assert seen == set(rows)


def asked_conversations(folder: Path) -> dict[str, list]:
    return {c["id"]: c["messages"] for c in iter_jsonl(results(folder) / "prompts/conversations.jsonl")}


def test_generation_asked_and_extraction_computed_exactly_what_the_edit_made_new(any_edit):
    run, start, edit = any_edit["incremental"], any_edit["before"], any_edit["edit"]
    before, now = asked_conversations(start), asked_conversations(run)
    answered_before = [] if edit in NEW_ANSWER_STORE else list(before.values())
    new_conversations = [c for c, messages in now.items() if messages not in answered_before]
    assert any_edit["requests"] == len(new_conversations)  # the server's count: one request per single-turn question
    generate_log = run / f"logs/{RUN}/generate_server-0.log"
    if edit == "max_seq_length_lowered":  # nothing generation reads changed: Snakemake leaves it be
        assert not generate_log.exists()
    else:
        generate = generate_log.read_text()
        assert f"{len(now)} conversations: {len(now) - len(new_conversations)} answered before" in generate
        assert f", {len(new_conversations)} to ask" in generate
        assert bool(re.search(r"Pipeline complete in [\d.]+s", generate)) == bool(new_conversations)  # the client ran
        assert ("1 other answer store(s) beside it" in generate) == (edit in NEW_ANSWER_STORE)

    old_rows, new_rows = prepared_rows(start), prepared_rows(run)
    changed = {s for s, ids in new_rows.items() if old_rows.get(s) != ids or edit == "one_tensor_edited"}
    extracted = sum(int(n) for n in re.findall(r"samples already on disk, (\d+) to extract", log(run, "extract_server-0")))
    assert extracted == len(changed)
    hs_before, hs_now = results(start) / "hidden_states", results(run) / "hidden_states"
    files_before = {p.name: p.stat().st_mtime_ns for p in layout.hidden_state_files(hs_before)}
    files_now = {p.name: p.stat().st_mtime_ns for p in layout.hidden_state_files(hs_now)}
    assert set(files_now) == {layout.file_name(s) for s in new_rows}  # no file that no row claims
    rewritten = {name for name, mtime in files_now.items() if files_before.get(name) != mtime}
    assert rewritten == {layout.file_name(s) for s in changed}
    if edit == "num_samples_grown":
        assert 0 < len(changed) < len(new_rows) and 0 < len(new_conversations) < len(now)
    elif edit == "prompt_files_edited":  # the added file's questions drawn, and the two edited
        assert 0 < len(changed) < len(new_rows) and 0 < len(new_conversations) < len(now)
        assert set(EDITED_QUESTIONS) < set(new_conversations) <= set(EDITED_QUESTIONS) | {c for c in now if c.startswith("r")}
        assert set(EDITED_QUESTIONS) < set(before)
    elif edit == "max_seq_length_lowered":
        assert 0 < len(changed) < len(new_rows) and not new_conversations
    elif edit == "num_samples_shrunk":
        assert not changed and not new_conversations and len(new_rows) < len(old_rows)
    elif edit in TARGET_EDITS:  # every answer asked again, every sample extracted again; the prompts kept
        assert len(new_conversations) == len(now) and changed == set(new_rows) == set(old_rows)
        sampled = "prompts/conversations.jsonl"
        assert (results(run) / sampled).stat().st_mtime_ns == (results(start) / sampled).stat().st_mtime_ns

    # python -m draftflow.plan before the rerun, and the plan the rerun wrote as it started
    for plan in (any_edit["plan"], json.loads((results(run) / "run_plan.json").read_text())):
        stages = {s["name"]: s for s in plan["stages"]}
        assert (stages["generate_server"]["reused"], stages["generate_server"]["computed"]) == (len(now) - len(new_conversations), len(new_conversations))
        assert (stages["extract_server"]["reused"], stages["extract_server"]["computed"]) == (len(new_rows) - len(changed), len(changed))
        assert plan["tokens"]["samples"] == len(new_rows)
        assert stages["generate_server"]["model_loads"] == 0  # generate.endpoint: the module's server
        assert (stages["generate_server"]["seconds"] == 0) == (not new_conversations)
        assert (stages["extract_server"]["model_loads"] == 0) == (not changed)
        assert (stages["extract_server"]["seconds"] > 0) == bool(changed)  # the hours it costs


def test_the_incremental_run_makes_the_clean_runs_files(edited):
    clean, incremental = (results(edited[k]) for k in ("clean", "incremental"))
    trained = edited["edit"] in EDITS_RUN_TO_EVALUATION  # else the earlier drafter and evaluation stay, not rebuilt
    renames = {str(edited["incremental"]).encode(): str(edited["clean"]).encode()}
    compared = assert_same_files(clean, incremental, renames, stages=None if trained else VIEW_STAGES)
    assert {"synthetic/generated.jsonl", "prepared/dataset/state.json", "training_data/split.json"} <= compared
    assert ({"drafter_trained/model.safetensors", "evaluation/evaluation.json"} <= compared) == trained
    assert sum(name.startswith("hidden_states/shard-") and name.endswith(".safetensors") for name in compared) == len(
        prepared_rows(edited["clean"])
    )


def copy_of(start: Path, folder: Path) -> Path:
    """The start run's folder as a user's second run finds it, its logs left out."""
    shutil.copytree(start, folder, symlinks=True, ignore=shutil.ignore_patterns("logs"))
    return folder


def same_shape_impostor(real: Path, other: Path) -> dict:
    """Another sample's states and token ids, cut or repeated to ``real``'s length: a
    file of the right name and size that holds the wrong sample."""
    length = load_file(real)["token_ids"].numel()
    tensors = load_file(other)
    repeat = -(-length // tensors["token_ids"].numel())
    return {name: tensor.repeat(repeat, *[1] * (tensor.dim() - 1))[:length].contiguous() for name, tensor in tensors.items()}


def test_a_file_of_another_sample_under_a_samples_name_is_extracted_again(lab, server, start):
    folder = copy_of(start, lab / "planted")
    shard = results(folder) / "hidden_states/shard-0"
    victim, other = sorted(shard.glob("hs_*.safetensors"))[:2]
    original = victim.read_bytes()
    save_file(same_shape_impostor(victim, other), str(victim))
    assert victim.stat().st_size == len(original) and victim.read_bytes() != original
    snakemake(folder, config(lab, server), f"results/{RUN}/hidden_states/manifest.json", "--forcerun", "extract_server")
    assert "shard 0: " in log(folder, "extract_server-0") and ", 1 to extract;" in log(folder, "extract_server-0")
    assert victim.read_bytes() == original


def test_training_and_evaluation_refuse_a_file_whose_token_ids_are_not_its_rows(lab, server, start):
    folder = copy_of(start, lab / "mismatched")
    # evaluate first: a failed train job's outputs are gone, and evaluate would train again
    for view, rule, output in (("heldout", "evaluate", "evaluation/evaluation.json"), ("train", "train", "drafter_trained")):
        links = results(folder) / "training_data" / view / "hidden_states"
        victim, other = (links / f"hs_{row}.safetensors" for row in (0, 1))
        sample_id = load_from_disk(str(links.parent)).with_format(None)["sample_id"][0]
        real = victim.resolve()
        shutil.copyfile(other.resolve(), real)
        process = snakemake(folder, config(lab, server), f"results/{RUN}/{output}", "--forcerun", rule, check=False)
        assert process.returncode != 0
        message = log(folder, rule)
        assert f"Hidden-state file {real} of sample {sample_id} (row 0 of" in message
        assert "snakemake --forcerun extract_server" in message
        shutil.copyfile(results(start) / real.relative_to(results(folder)), real)  # put it back for the next rule


# The plan of a config nothing has run yet, fed the start run's rates, against the clean run
# of that config (4 more samples; generate through the module's server: no model load). The
# bounds are what it measured on 2026-12-01 with room for the machine's load: hidden-state
# bytes 0.82 of the files with 48-token answers (prompt tokens by characters / 4 undercount
# the twin's rendered prompts: 14 of 28; with the 32-token answers since 2026-12-06, 0.77),
# the stages' times 0.6-1.7 of their benchmarks; generate, which asks the module's CPU server
# one conversation at a time, measured 0.31 in one suite run (21:00, 2026-12-01): the stage
# most at the mercy of what else the machine runs. It measured 4.4 when the start
# run shared the suite's first minutes with pip's install, which the schedule now keeps
# it out of (conftest.SCHEDULE).
PLAN_BYTES_WITHIN = (0.7, 1.05)
PLAN_SECONDS_WITHIN = (0.25, 2.5)
SCALED_STAGES = ("generate_server", "prepare", "extract_server", "train")


def test_the_plan_from_another_runs_rates_foretells_a_larger_clean_run(lab, edit_runs, tmp_path):
    grown = edit_runs("num_samples_grown")
    clean, start = grown["clean"], grown["before"]
    for prompts in (PROMPTS, MORE_PROMPTS):  # the folder as it was before the clean run: prompts and target
        shutil.copy(clean / prompts, tmp_path / prompts)
    shutil.copytree(clean / TARGET, tmp_path / TARGET)
    config = load_config(config_file(tmp_path, grown["config"]))
    plan = build_plan(config, tmp_path / f"results/{RUN}", rates_from_run(results(start)), free_bytes=10**12, local_gpus=0)
    stages = {stage.name: stage for stage in plan.stages}
    assert plan.tokens["samples"] == len(prepared_rows(clean)) != len(prepared_rows(start))
    assert stages["extract_server"].computed == len(prepared_rows(clean))
    written = sum(path.stat().st_size for path in layout.hidden_state_files(results(clean) / "hidden_states"))
    low, high = PLAN_BYTES_WITHIN
    assert low <= stages["extract_server"].bytes_written / written <= high, (stages["extract_server"].bytes_written, written)
    measured = {name: read_benchmark(clean / run_folder.benchmark_path(RUN, STAGE[name].benchmark_names({"generate_server": 1, "extract_server": 1})[0]))["seconds"]
                for name in SCALED_STAGES}  # fmt: skip
    low, high = PLAN_SECONDS_WITHIN
    ratios = {name: stages[name].seconds / seconds for name, seconds in measured.items()}
    assert all(low <= ratio <= high for ratio in ratios.values()), ratios
