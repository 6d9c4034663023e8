"""Which chat template generation rendered with, as generate records it and prepare
checks it (issue 26), on tokenizers saved and loaded by transformers."""

import hashlib
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from draftflow.chat_template import UNKNOWN, check_generation_used, flag_value, generation_record, served_template

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
OTHER = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"


def saved_tokenizer(folder: Path, template: str):
    """A word-level tokenizer saved with ``template`` as its own, loaded back."""
    words = models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]")
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(words), chat_template=template).save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_the_flag_is_read_in_either_spelling():
    assert flag_value(["--dtype", "float32", "--chat-template", "t.jinja"]) == "t.jinja"
    assert flag_value(["--chat-template={{ x }}"]) == "{{ x }}"
    assert flag_value(["--dtype", "float32"]) is None


def test_generation_records_the_tokenizers_own_template_and_prepare_stops_once_it_changed(tmp_path):
    tokenizer = saved_tokenizer(tmp_path, TEMPLATE)
    record = generation_record(tokenizer, str(tmp_path), ["--dtype", "float32"])
    assert record["sha256"] == sha256(TEMPLATE) and record["source"].startswith("the tokenizer's own (")
    check_generation_used(record, *served_template(tokenizer, str(tmp_path), None), tmp_path / "stats.json")
    edited = saved_tokenizer(tmp_path, OTHER)
    with pytest.raises(ValueError, match=r"generation rendered its prompts with \(the tokenizer's own .*sha256 "
                                         rf"{sha256(TEMPLATE)[:12]}, .*stats\.json\) is not the one to render with now .*"
                                         rf"sha256 {sha256(OTHER)[:12]}.*--forcerun generate"):  # fmt: skip
        check_generation_used(record, *served_template(edited, str(tmp_path), None), tmp_path / "stats.json")


def test_a_template_the_flag_names_is_the_one_recorded_and_checked(tmp_path):
    tokenizer = saved_tokenizer(tmp_path / "target", TEMPLATE)
    given = tmp_path / "served.jinja"
    given.write_text(OTHER)
    record = generation_record(tokenizer, str(tmp_path / "target"), ["--chat-template", str(given)])
    assert record == {"source": f"the file {given} (vllm.extra_args --chat-template)", "sha256": sha256(OTHER)}
    check_generation_used(record, *served_template(tokenizer, str(tmp_path / "target"), str(given)), given)
    with pytest.raises(ValueError, match="the tokenizer's own"):  # the flag since taken out of vllm.extra_args
        check_generation_used(record, *served_template(tokenizer, str(tmp_path / "target"), None), given)


def test_an_endpoints_template_is_said_to_be_unknown_and_not_checked(tmp_path):
    tokenizer = saved_tokenizer(tmp_path, TEMPLATE)
    record = generation_record(tokenizer, str(tmp_path), None)
    assert record == {"source": UNKNOWN, "sha256": None}
    check_generation_used(record, *served_template(saved_tokenizer(tmp_path, OTHER), str(tmp_path), None), tmp_path)
