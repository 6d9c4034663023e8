"""Stage 3: generated rows → speculators' training dataset and token frequencies."""

from __future__ import annotations

import os
from dataclasses import asdict
from functools import partial
from pathlib import Path

from datasets import Dataset
from speculators.data_generation.preprocessing import build_speculator_training_dataset
from speculators.train.vocab_mapping import save_token_frequency_distribution
from transformers import AutoTokenizer

from draftflow.chat_template import check_generation_used, served_template, tokenizer_template_file
from draftflow.io import atomic_path, iter_jsonl, read_json, write_json
from draftflow.prepared_rows import CATEGORY, EVALUATION_SET, PrepareStats, evaluation_label, mask_mismatches, select_rows


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


def check_assistant_span(tokenizer, template: str | None, source: str, template_kwargs: dict) -> None:
    """Stop when the chat template, given ``template_kwargs`` as generation gave them,
    renders no assistant turn after its generation prompt: the loss mask covers that
    span, so every mask would be empty."""
    render = partial(tokenizer.apply_chat_template, chat_template=template, tokenize=False, **template_kwargs)
    prompt = render(PROBE_QUESTION, add_generation_prompt=True)
    full = render([*PROBE_QUESTION, {"role": "assistant", "content": PROBE_ANSWER}])
    span = full[len(os.path.commonprefix([prompt, full])) :]
    if PROBE_ANSWER not in span:
        raise ValueError(
            f"The chat template, {source}, gives no assistant "
            f"span: an answer after a user turn renders {span!r} after the generation prompt, "
            "so every loss mask would be empty. Use a template that renders assistant turns."
        )


def check_masks(rows: list[dict], masks: list[list[int]], max_length: int, source: Path) -> None:
    """Stop unless every prepared row trains on exactly the tokens the server generated."""
    if mismatches := mask_mismatches(rows, masks, max_length):
        listed = "; ".join(mismatches[:5]) + (f"; and {len(mismatches) - 5} more" if len(mismatches) > 5 else "")
        raise ValueError(
            f"{source}: the loss mask of {len(mismatches)} of {len(rows)} rows does not cover exactly "
            f"the answer tokens the server generated: {listed}. Trained on, they would teach the "
            "drafter tokens the target did not answer. generate's client masks exactly those "
            "tokens: check what else wrote or edited these rows (here or in the answer store "
            "beside it, work/), then generate them again."
        )


def prepare(
    samples: Path,
    generation_stats: Path,
    target: str,
    *,
    chat_template: str | None,
    max_length: int,
    minimum_valid_tokens: int,
    on_too_long: str,
    dataset_output: Path,
    token_freq_output: Path,
    stats_output: Path,
    evaluation_sets: dict,
) -> PrepareStats:
    tokenizer = AutoTokenizer.from_pretrained(target)
    source, template = served_template(tokenizer, target, chat_template)
    generated = read_json(generation_stats)
    check_assistant_span(tokenizer, template, source, generated["sampling"]["request"].get("chat_template_kwargs", {}))
    check_generation_used(generated["chat_template"], source, template, generation_stats)
    rows = list(iter_jsonl(samples))
    for row in rows:
        check_token_ids(row, len(tokenizer), samples)
    stats = PrepareStats(rows_in=len(rows))
    rows = select_rows(rows, max_length, minimum_valid_tokens, on_too_long, stats)
    if not rows:
        raise ValueError(
            f"{samples}: no sample has {minimum_valid_tokens}+ supervised (assistant) tokens "
            f"within prepare.max_seq_length={max_length} ({asdict(stats)}). If every answer "
            f"is empty, check the chat template ({tokenizer_template_file(target)}, or "
            "vllm.extra_args --chat-template): its generation prompt must open an assistant turn."
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
    check_masks(rows, dataset["loss_mask"], max_length, samples)
    dataset = dataset.add_column("sample_id", [row["id"] for row in rows])
    labels = [evaluation_label(evaluation_sets, row["primary_id"]) for row in rows]
    dataset = dataset.add_column(EVALUATION_SET, [label[0] for label in labels])
    dataset = dataset.add_column(CATEGORY, [label[1] for label in labels])
    training = [i for i, (name, _) in enumerate(labels) if not name]
    with atomic_path(token_freq_output) as tmp:  # the draft vocabulary sees no evaluation set
        save_token_frequency_distribution(dataset.select(training), tmp)
    with atomic_path(dataset_output) as tmp:
        dataset.save_to_disk(str(tmp))
    write_json(stats_output, asdict(stats))
    return stats
