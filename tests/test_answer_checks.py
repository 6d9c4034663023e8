"""Answers a target served wrong would give are found, counted and, past a share, stop generation."""

import json

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from draftflow.answer_checks import CUT, EMPTY, LOOP, ONE_TOKEN, SAME, FlawedAnswers, answer_flaws, check_answers
from draftflow.answers import AppendedRows, complete_length
from draftflow.generate import CLIENT_RETRY_BACKOFF_BASE, EARLY_ANSWERS, EarlyAnswerCheck, GenerationSettings
from draftflow.io import write_jsonl

MAX_TOKENS = 40


def row(row_id, prompt, answer):
    return {"id": row_id, "input_ids": [*prompt, *answer], "loss_mask": [0] * len(prompt) + [1] * len(answer)}


GOOD = [row(f"good-{i}", [1, 2, 100 + i], list(range(200 + 10 * i, 212 + 10 * i))) for i in range(6)]
FLAWED = [
    row("one-token", [1, 3], [7] * 12),
    row("loop", [1, 4], [5, 6, 8, 9, 10] + [11, 12, 13] * 6),
    row("cut", [1, 5], list(range(300, 300 + MAX_TOKENS))),
    row("empty", [1, 6], []),
    row("same-a", [1, 7], list(range(400, 410))),
    row("same-b", [1, 8, 9], list(range(400, 410))),
]


def test_each_flaw_is_found_on_its_answer_and_good_answers_have_none():
    flaws = answer_flaws(GOOD + FLAWED, MAX_TOKENS)
    assert flaws == {"one-token": [ONE_TOKEN, LOOP], "loop": [LOOP], "cut": [CUT], "empty": [EMPTY],
                     "same-a": [SAME], "same-b": [SAME]}  # fmt: skip
    short_answers_alike = [row("yes-1", [1, 2], [50, 51]), row("yes-2", [1, 3], [50, 51])]
    assert answer_flaws(short_answers_alike, MAX_TOKENS) == {}  # "Yes." twice is no flaw
    same_prompt_twice = [row("a", [1, 2], list(range(60, 70))), row("b", [1, 2], list(range(60, 70)))]
    assert answer_flaws(same_prompt_twice, MAX_TOKENS) == {}


def test_two_turns_of_one_conversation_answered_alike_are_no_flaw_but_another_conversations_alike_answer_is():
    answer = list(range(60, 72))
    turns = [{**row(f"c1-turn{t}", [1, 2, t], answer), "primary_id": "c1"} for t in range(2)]
    assert answer_flaws(turns, MAX_TOKENS) == {}
    other = {**row("c2-turn0", [1, 3], answer), "primary_id": "c2"}
    assert answer_flaws([*turns, other], MAX_TOKENS) == {"c1-turn0": [SAME], "c1-turn1": [SAME], "c2-turn0": [SAME]}
    # another conversation asking c1's first prompt again: only c1's second turn differs from it
    asked_again = {**row("c3-turn0", [1, 2, 0], answer), "primary_id": "c3"}
    assert answer_flaws([*turns, asked_again], MAX_TOKENS) == {"c1-turn1": [SAME], "c3-turn0": [SAME]}


def test_too_many_flawed_answers_stop_generation_naming_the_worst_and_the_causes():
    rows = GOOD + FLAWED
    flaws = answer_flaws(rows, MAX_TOKENS)
    check_answers(rows, flaws, str, 0.5, "generate.max_degenerate_fraction", "counts in stats.json")  # 6 of 12
    with pytest.raises(FlawedAnswers) as refused:
        check_answers(rows, flaws, str, 0.25, "generate.max_degenerate_fraction", "counts in stats.json")
    message = str(refused.value)
    assert message.startswith("6 of 12 answers are flawed (more than generate.max_degenerate_fraction=0.25; counts in stats.json)")
    assert message.splitlines()[1].startswith("  one-token (one token repeated, a short loop filling most of it): '[7, 7")
    assert "output head" in message and "generate.max_tokens" in message and "max_degenerate_fraction: 1" in message


@pytest.fixture
def tokenizer_dir(tmp_path):
    vocabulary = {"[UNK]": 0, **{str(i): i for i in range(1, 500)}}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))).save_pretrained(
        tmp_path / "tokenizer"
    )
    return tmp_path / "tokenizer"


def test_the_early_check_reads_only_this_runs_first_answers(tmp_path, tokenizer_dir):
    store = tmp_path / "answers.jsonl"
    write_jsonl(store, GOOD * 10)  # an earlier run's answers: not this run's to check
    settings = GenerationSettings(max_tokens=MAX_TOKENS, temperature=0.0, concurrency=1, max_retries=0, seed=0,
                                  reasoning_end_marker="", max_error_fraction=0.1, max_degenerate_fraction=0.25)  # fmt: skip
    check = EarlyAnswerCheck(store, settings, str(tokenizer_dir))
    looping = [row(f"loop-{i}", [1, 9, i], [7] * 12) for i in range(EARLY_ANSWERS)]
    with store.open("a") as stream:
        stream.writelines(json.dumps(answer) + "\n" for answer in looping[:-1])
    check()  # 31 of this run's answers: not yet
    with store.open("a") as stream:
        stream.write(json.dumps(looping[-1]) + "\n")
    with pytest.raises(FlawedAnswers, match=rf"^{EARLY_ANSWERS} of {EARLY_ANSWERS} answers are flawed .*the first {EARLY_ANSWERS} answers of this run"):
        check()


def test_appended_rows_parse_only_the_bytes_written_since_the_last_read(tmp_path):
    store = tmp_path / "answers.jsonl"
    store.write_bytes(b'{"n": 0}\n{"n": 1}\n')  # an earlier run's rows
    appended = AppendedRows(store)
    with store.open("ab") as stream:
        stream.write(b'{"n": 2}\n{"n": 3')
    assert appended.new() == [{"n": 2}]  # the last row is not complete yet
    store.write_bytes(b"x" * 27 + store.read_bytes()[27:])  # the bytes read before: never parsed again
    with store.open("ab") as stream:
        stream.write(b"}\n")
    assert appended.new() == [{"n": 3}] and appended.new() == []


def test_the_complete_length_ends_at_the_last_newline_read_from_the_end(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"n": 0}\n{"n": 1}\n{"n": 2')
    assert complete_length(path, block=4) == complete_length(path) == 18
    path.write_bytes(b'{"n": 0')
    assert complete_length(path, block=4) == 0 and complete_length(tmp_path / "absent.jsonl") == 0


def test_the_retry_window_follows_the_clients_own_backoff():
    """generate waits out the retries of speculators' client without importing it."""
    from speculators.data_generation.vllm_client import RETRY_BACKOFF_BASE

    assert CLIENT_RETRY_BACKOFF_BASE == RETRY_BACKOFF_BASE
