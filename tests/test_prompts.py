import json

import pytest

from draftflow.plan import DEFAULT_RATES, work_from_stats
from draftflow.prompts import BadPromptRow, safe_sample_id, select_prompts


def write_lines(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def openai_row(i, text=None):
    return {
        "id": f"q{i}",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": text or f"question {i}"},
            {"role": "assistant", "content": "old answer, regenerated"},
        ],
    }


def sharegpt_row(i):
    return {"conversations": [{"from": "human", "value": f"sharegpt {i}"}, {"from": "gpt", "value": "x"}]}


def test_both_formats_normalise_to_system_and_user_turns(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [openai_row(1), sharegpt_row(2)])
    rows, stats = select_prompts([path], num_samples=10, seed=0, on_bad_row="fail")
    by_text = {row["messages"][-1]["content"]: row for row in rows}
    assert by_text["question 1"]["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "question 1"},
    ]
    assert by_text["question 1"]["id"] == "q1"
    assert by_text["sharegpt 2"]["messages"] == [{"role": "user", "content": "sharegpt 2"}]
    assert by_text["sharegpt 2"]["id"].startswith("h")
    assert stats.sampled == 2


def test_duplicates_are_dropped_and_counted(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [openai_row(1), openai_row(1), sharegpt_row(2)])
    rows, stats = select_prompts([path], num_samples=10, seed=0, on_bad_row="fail")
    assert len(rows) == 2
    assert stats.duplicates == 1


def test_sampling_is_seeded_and_stable_as_n_grows(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [openai_row(i) for i in range(100)])
    small, _ = select_prompts([path], num_samples=10, seed=3, on_bad_row="fail")
    large, _ = select_prompts([path], num_samples=30, seed=3, on_bad_row="fail")
    again, _ = select_prompts([path], num_samples=10, seed=3, on_bad_row="fail")
    other, _ = select_prompts([path], num_samples=10, seed=4, on_bad_row="fail")
    ids = {row["id"] for row in small}
    assert small == again
    assert ids <= {row["id"] for row in large}
    assert ids != {row["id"] for row in other}


def test_bad_row_names_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(openai_row(1)) + "\n{not json\n")
    with pytest.raises(BadPromptRow, match=r"p\.jsonl, line 2"):
        select_prompts([path], num_samples=10, seed=0, on_bad_row="fail")
    rows, stats = select_prompts([path], num_samples=10, seed=0, on_bad_row="skip")
    assert len(rows) == 1 and stats.bad_rows == 1


def test_sample_ids_cannot_escape_a_directory():
    assert safe_sample_id("../../etc/passwd", "ab" * 32) == "etc_passwd"
    assert safe_sample_id("..", "ab" * 32) == "h" + "ab" * 8
    assert "/" not in safe_sample_id("a/b", "00" * 32)


def test_the_plan_counts_the_prompts_the_prompts_stage_would_sample(tmp_path, monkeypatch):
    """Before any run (no sampled conversations, prompt files found from the cwd), the plan's
    sample count is the prompts stage's: bad rows skipped or refused as data.on_bad_row says,
    duplicates dropped."""
    rows = [openai_row(1), openai_row(2), sharegpt_row(3), openai_row(1)]  # the last: a duplicate
    prompts = write_lines(tmp_path / "prompts.jsonl", rows)
    with prompts.open("a") as stream:
        stream.write('{"messages": [{"role": "user", "content": "a \x01 control character"}]}\n')
    config = {"seed": 0, "data": {"prompt_files": ["prompts.jsonl"], "num_samples": 10, "on_bad_row": "skip"},
              "generate": {"max_tokens": 64}, "prepare": {"max_seq_length": 512}}  # fmt: skip
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "elsewhere/results/demo"
    assert work_from_stats(config, run_dir, DEFAULT_RATES["cpu"])["samples"] == 3
    config["data"]["on_bad_row"] = "fail"
    with pytest.raises(BadPromptRow, match=r"prompts.jsonl, line 5: .*data.on_bad_row: skip"):
        work_from_stats(config, run_dir, DEFAULT_RATES["cpu"])
