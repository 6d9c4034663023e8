import json
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from demo import target as demo_target

QUESTION = [{"role": "user", "content": "Explain `json.dumps`."}]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A demo target trained for two steps: checks the files, not the quality."""
    output_dir = tmp_path_factory.mktemp("demo-target")
    return output_dir, demo_target.build_demo_target(output_dir, train_steps=2)


def test_stdlib_entries_are_short_unique_and_partly_held_out() -> None:
    _, entries = demo_target.stdlib_docs()
    names = [entry.name for entry in entries]
    assert len(names) == len(set(names)) > 1000
    assert all(len(entry.summary) <= demo_target.MAX_SUMMARY_CHARS for entry in entries)
    held_out = sum(map(demo_target.is_held_out, entries)) / len(entries)
    assert 0.05 < held_out < 0.15


def test_assistant_answer_opens_and_closes_think_block() -> None:
    entry = demo_target.DocEntry("json.dumps", "json", "function", "Serialize obj.")
    answer = demo_target.assistant_answer(entry)
    assert answer.startswith(
        "<think>\nThe user asks about `json.dumps`, a function in module `json`."
    )
    assert answer.endswith("\n</think>\nSerialize obj.")


def test_chat_template_renders_roles_and_generation_prompt(built: tuple[Path, dict]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(built[0])
    messages = [{"role": "system", "content": "Be brief."}, *QUESTION]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|bos|><|system|>\nBe brief.<|end|>"
        "<|user|>\nExplain `json.dumps`.<|end|>"
        "<|assistant|>\n"
    )
    assert tokenizer.eos_token == "<|end|>"
    assert len(tokenizer) == demo_target.VOCAB_SIZE


def test_think_tokens_are_single_ids_kept_by_decode(built: tuple[Path, dict]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(built[0])
    ids = tokenizer.encode("<think>\nx\n</think>\ny<|end|>", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens([ids[0], ids[-1]]) == ["<think>", "<|end|>"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>\nx\n</think>\ny"


def test_model_shape_and_generation(built: tuple[Path, dict]) -> None:
    output_dir, summary = built
    config = AutoConfig.from_pretrained(output_dir)
    shape = (config.num_hidden_layers, config.head_dim, config.max_position_embeddings)
    assert shape == (8, 64, 1024)
    assert config.eos_token_id == AutoTokenizer.from_pretrained(output_dir).eos_token_id
    assert not config.tie_word_embeddings
    assert (output_dir / "model.safetensors").is_file()
    assert (output_dir / "generation_config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(output_dir)
    assert summary["parameters"] == sum(p.numel() for p in model.parameters())
    # README's "2.5M", from the shape alone: embedding and untied lm_head (3,072 x 128 each), 8 layers
    # of q, k, v, o (128 x 128 each), gate, up, down (128 x 384 each) and two norms, the final norm
    assert summary["parameters"] == 2 * 3072 * 128 + 8 * (4 * 128 * 128 + 3 * 128 * 384 + 2 * 128) + 128 == 2_492_544


def test_demo_prompts_mix_formats_with_duplicates(tmp_path: Path) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    demo_target.write_demo_prompts(first, count=100, seed=3)
    demo_target.write_demo_prompts(second, count=100, seed=3)
    assert first.read_bytes() == second.read_bytes()
    lines = first.read_text().splitlines()
    assert len(lines) == 100 and len(set(lines)) == 98
    rows = [json.loads(line) for line in lines]
    openai = [row for row in rows if "messages" in row]
    sharegpt = [row for row in rows if "conversations" in row]
    assert len(openai) + len(sharegpt) == 100 and min(len(openai), len(sharegpt)) > 25
    assert {turn["role"] for row in openai for turn in row["messages"]} <= {"system", "user"}
    assert {turn["from"] for row in sharegpt for turn in row["conversations"]} <= {
        "system",
        "human",
    }
    _, entries = demo_target.stdlib_docs()
    held_out = {entry.name for entry in entries if demo_target.is_held_out(entry)}
    asked = [line.split("`")[1] for line in lines]
    assert 0.2 < sum(name in held_out for name in asked) / len(asked) < 0.5
