"""Stages 1–4 on the demo target, through real Snakemake and a real vLLM CPU server."""

import json

import numpy as np
import pytest
from datasets import load_from_disk
from transformers import AutoTokenizer

from draftflow.answer_checks import MIN_TOKENS_FOR_REPEATS
from draftflow.io import iter_jsonl
from tests.conftest import demo_config, snakemake

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tokenizer(demo_run):
    return AutoTokenizer.from_pretrained(demo_run.parents[1] / "resources/demo-target")


def test_prompts_are_deduplicated_and_sampled(demo_run):
    stats = json.loads((demo_run / "prompts/stats.json").read_text())
    rows = list(iter_jsonl(demo_run / "prompts/conversations.jsonl"))
    assert stats["duplicates"] > 0
    evaluation_sets = json.loads((demo_run / "prompts/evaluation_sets.json").read_text())
    evaluation = [row for row in rows if any(row["id"] in listed["samples"] for listed in evaluation_sets.values())]
    assert len(rows) - len(evaluation) == stats["sampled"] == demo_config()["data"]["num_samples"]
    assert len(evaluation) == sum(s["sampled"] for s in stats["evaluation_sets"].values()) == 80  # MT-Bench
    assert len({row["id"] for row in rows}) == len(rows)


def test_generated_tokens_are_the_target_rendering_plus_its_answer(demo_run, tokenizer):
    conversations = {row["id"]: row for row in iter_jsonl(demo_run / "prompts/conversations.jsonl")}
    rows = list(iter_jsonl(demo_run / "synthetic/generated.jsonl"))
    assert len(rows) > 0.9 * len(conversations)
    single_turn = [row for row in rows if sum(t["role"] == "user" for t in conversations[row["primary_id"]]["messages"]) == 1]
    assert len(single_turn) > 0.9 * demo_config()["data"]["num_samples"]  # MT-Bench's two turns: tests/test_multi_turn.py
    for row in single_turn:
        prompt = tokenizer.apply_chat_template(
            conversations[row["primary_id"]]["messages"], add_generation_prompt=True, return_dict=False
        )
        assert row["input_ids"][: len(prompt)] == list(prompt)
        assert row["loss_mask"] == [0] * len(prompt) + [1] * (len(row["input_ids"]) - len(prompt))
        assert max(row["input_ids"]) < len(tokenizer)


def test_generation_stats_record_reasoning_and_throughput(demo_run):
    stats = json.loads((demo_run / "synthetic/stats.json").read_text())
    assert stats["samples"] > 0
    assert 0.5 < stats["reasoning_capture_rate"] <= 1.0
    assert stats["mean_response_tokens"] > 5
    assert stats["response_tokens_per_second"] > 0
    assert stats["errors"] == len(list(iter_jsonl(demo_run / "synthetic/errors.jsonl")))
    mt_bench_answers = sum(row["primary_id"].startswith("mt_bench-") for row in iter_jsonl(demo_run / "synthetic/generated.jsonl"))
    assert stats["multi_turn_conversations"] == 80 and stats["user_turns_lost"] == 2 * 80 - mt_bench_answers  # MT-Bench's
    assert bool(stats["warnings"]) == (stats["conversations_with_lost_turns"] > 0.05 * stats["conversations"])


def test_the_cpu_server_runs_its_model_in_the_engine_process(demo_run):
    """vllm.cpu_single_process (the default): an API server and an engine, no worker process."""
    log = (demo_run.parents[1] / "logs/demo/generate_server-0.server.log").read_text()
    assert "(EngineCore pid=" in log and "Worker pid=" not in log


def test_generation_counts_the_flawed_answers_the_rows_hold(demo_run):
    """The demo's answers: most flaws the same memorised answer to two phrasings of one question
    (36 of 240 on the hosts of 2026-12-01, 54 here on 2026-12-04; the same bytes twice on each),
    now and then one cut at generate.max_tokens. The counts are the rows' own, recounted here from
    generated.jsonl: an answer long enough to count repeats given to another conversation's other prompt."""
    stats = json.loads((demo_run / "synthetic/stats.json").read_text())
    evaluation_sets = json.loads((demo_run / "prompts/evaluation_sets.json").read_text())
    evaluation_ids = {sample for listed in evaluation_sets.values() for sample in listed["samples"]}
    every_row = list(iter_jsonl(demo_run / "synthetic/generated.jsonl"))
    rows = [row for row in every_row if row["primary_id"] not in evaluation_ids]  # MT-Bench's are counted apart
    assert stats["evaluation_set_answers"]["answers"] == len(every_row) - len(rows) > 0
    max_tokens = demo_config()["generate"]["max_tokens"]
    assert stats["truncated"] == sum(row["loss_mask"].count(1) >= max_tokens for row in rows) <= 2
    split = [(row["primary_id"], *(tuple(t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m == part)
                                   for part in (1, 0))) for row in rows]  # fmt: skip
    shared = sum(len(answer) >= MIN_TOKENS_FOR_REPEATS
                 and any(a == answer and c != conversation and p != prompt for c, a, p in split)
                 for conversation, answer, prompt in split)  # fmt: skip
    assert shared > 0 and stats["answer_flaws"]["the same answer as another conversation's, to a different prompt"] == shared
    assert shared <= stats["flawed_answers"] <= sum(stats["answer_flaws"].values())


def test_prepared_dataset_masks_only_assistant_tokens(demo_run):
    dataset = load_from_disk(str(demo_run / "prepared/dataset"))
    generated = {row["id"]: row for row in iter_jsonl(demo_run / "synthetic/generated.jsonl")}
    assert len(dataset) > 0
    for row in dataset:
        source = generated[row["sample_id"]]
        assert row["loss_mask"].sum() > 0
        assert row["input_ids"].tolist() == source["input_ids"][: len(row["input_ids"])]
        assert row["loss_mask"].tolist() == source["loss_mask"][: len(row["loss_mask"])]


def test_vocab_map_is_consistent(demo_run, tokenizer):
    k = demo_config()["vocab"]["draft_vocab_size"]
    d2t = np.load(demo_run / "vocab/d2t.npy")
    t2d = np.load(demo_run / "vocab/t2d.npy")
    assert d2t.shape == (k,) and t2d.shape == (len(tokenizer),)
    assert t2d.sum() == k
    targets = np.arange(k) + d2t
    assert targets.min() >= 0 and targets.max() < len(tokenizer)
    assert t2d[targets].all()
    coverage = json.loads((demo_run / "vocab/coverage.json").read_text())
    curve = [coverage["curve"][key] for key in sorted(coverage["curve"], key=int)]
    assert all(0 < value <= 1 for value in curve)
    assert curve == sorted(curve) and curve[0] < curve[-1]
    assert (demo_run / "vocab/coverage.png").stat().st_size > 1000


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"vocab": {"draft_vocab_sise": 10}}, ("'draft_vocab_sise' was unexpected",)),
        ({"data": {"num_samples": "many"}}, ("'many' is not of type 'integer'", "['num_samples']")),
        ({"device": "tpu"}, ("'tpu' is not one of ['cpu', 'cuda']", "['device']")),
    ],
)
def test_schema_rejects_bad_config_naming_the_key(tmp_path, overrides, message):
    process = snakemake(tmp_path, demo_config(**overrides), "-n", check=False)
    assert process.returncode != 0
    assert all(part in process.stdout + process.stderr for part in message)
