"""Stage 3: generated rows → speculators' training dataset and token frequencies."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from datasets import Dataset
from speculators.data_generation.preprocessing import build_speculator_training_dataset
from speculators.train.vocab_mapping import save_token_frequency_distribution
from transformers import AutoTokenizer

from draftflow.io import atomic_path, iter_jsonl, write_json
from draftflow.prepared_rows import PrepareStats, select_rows


def check_token_ids(row: dict, vocab_size: int, source: Path) -> None:
    bad = [t for t in row["input_ids"] if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"{source}: sample {row['id']} has token ids outside the target's "
            f"vocabulary of {vocab_size} (e.g. {bad[:3]}). The samples were "
            "generated with another tokenizer: rerun generation for this target."
        )


PROBE_QUESTION = [{"role": "user", "content": "What does len() return?"}]
PROBE_ANSWER = "The number of items."


def check_assistant_span(tokenizer, target: str) -> None:
    """Stop when the chat template renders no assistant turn after its generation
    prompt: the loss mask covers that span, so every mask would be empty."""
    prompt = tokenizer.apply_chat_template(PROBE_QUESTION, add_generation_prompt=True, tokenize=False)
    answered = [*PROBE_QUESTION, {"role": "assistant", "content": PROBE_ANSWER}]
    full = tokenizer.apply_chat_template(answered, tokenize=False)
    span = full[len(os.path.commonprefix([prompt, full])) :]
    if PROBE_ANSWER not in span:
        raise ValueError(
            f"The chat template of {target} ({chat_template_file(target)}) gives no assistant "
            f"span: an answer after a user turn renders {span!r} after the generation prompt, "
            "so every loss mask would be empty. Use a template that renders assistant turns."
        )


def chat_template_file(target: str) -> Path:
    jinja = Path(target) / "chat_template.jinja"
    return jinja if jinja.exists() else Path(target) / "tokenizer_config.json"


def prepare(
    samples: Path,
    target: str,
    *,
    max_length: int,
    minimum_valid_tokens: int,
    on_too_long: str,
    dataset_output: Path,
    token_freq_output: Path,
    stats_output: Path,
) -> PrepareStats:
    tokenizer = AutoTokenizer.from_pretrained(target)
    check_assistant_span(tokenizer, target)
    rows = list(iter_jsonl(samples))
    for row in rows:
        check_token_ids(row, len(tokenizer), samples)
    stats = PrepareStats(rows_in=len(rows))
    rows = select_rows(rows, max_length, minimum_valid_tokens, on_too_long, stats)
    if not rows:
        raise ValueError(
            f"{samples}: no sample has {minimum_valid_tokens}+ supervised (assistant) tokens "
            f"within prepare.max_seq_length={max_length} ({asdict(stats)}). If every answer "
            f"is empty, check the chat template in {target}/tokenizer_config.json: its "
            "generation prompt must open an assistant turn."
        )
    columns = {key: [row[key] for row in rows] for key in ("input_ids", "loss_mask")}
    dataset = build_speculator_training_dataset(
        Dataset.from_dict(columns),
        tokenizer,
        max_length=max_length,
        num_proc=1,
        minimum_valid_tokens=minimum_valid_tokens,
    )
    if len(dataset) != len(rows):
        raise RuntimeError(f"speculators dropped {len(rows) - len(dataset)} rows")
    dataset = dataset.add_column("sample_id", [row["id"] for row in rows])
    with atomic_path(token_freq_output) as tmp:
        save_token_frequency_distribution(dataset, tmp)
    with atomic_path(dataset_output) as tmp:
        dataset.save_to_disk(str(tmp))
    write_json(stats_output, asdict(stats))
    return stats
