"""Which generated rows ``prepare`` keeps, the tokens each keeps, and the columns it adds
to speculators' (the evaluation set and category of a row): standard library only, so
the plan knows them before prepare runs."""

from __future__ import annotations

from dataclasses import dataclass

# Columns the prepared dataset adds beside speculators' and sample_id: the evaluation set a
# row belongs to ("" for the training prompts) and its category there ("" for none).
EVALUATION_SET, CATEGORY = "evaluation_set", "category"


def evaluation_label(evaluation_sets: dict, conversation_id: str) -> tuple[str, str]:
    """(set, category) of a conversation in the prompts stage's ``evaluation_sets.json``."""
    for name, listed in evaluation_sets.items():
        if conversation_id in listed["samples"]:
            return name, listed["samples"][conversation_id] or ""
    return "", ""


@dataclass
class PrepareStats:
    rows_in: int = 0
    kept: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_too_few_supervised_tokens: int = 0
    tokens: int = 0
    supervised_tokens: int = 0


def select_rows(
    rows: list[dict], max_length: int, minimum_valid_tokens: int, on_too_long: str, stats: PrepareStats
) -> list[dict]:
    """Rows that fit ``max_length`` (or are truncated to it, per ``on_too_long``)
    and keep at least ``minimum_valid_tokens`` supervised tokens."""
    kept = []
    for row in rows:
        if on_too_long == "drop" and len(row["input_ids"]) > max_length:
            stats.dropped_too_long += 1
            continue
        supervised = sum(row["loss_mask"][:max_length])
        if supervised < minimum_valid_tokens:
            stats.dropped_too_few_supervised_tokens += 1
            continue
        stats.truncated += len(row["input_ids"]) > max_length
        stats.tokens += min(len(row["input_ids"]), max_length)
        stats.supervised_tokens += supervised
        kept.append(row)
    stats.kept = len(kept)
    return kept


def prepared_token_ids(row: dict, max_length: int) -> list[int]:
    """A kept row's token ids in the prepared dataset: speculators truncates to ``max_length``."""
    return row["input_ids"][:max_length]


def generated_mask(row: dict, max_length: int) -> list[int] | None:
    """The loss mask a kept row must have once prepared: 0 over the prompt the server
    rendered, 1 over the tokens it generated (its ``metadata.usage`` counts), cut at
    ``max_length``; None for a row whose usage gives no counts."""
    usage = row.get("metadata", {}).get("usage") or {}
    if not {"prompt_tokens", "completion_tokens"} <= usage.keys():
        return None
    return ([0] * usage["prompt_tokens"] + [1] * usage["completion_tokens"])[:max_length]


def masked_span(mask: list[int]) -> str:
    positions = [i for i, m in enumerate(mask) if m]
    return f"{positions[0]}-{positions[-1]}" if positions else "none"


def mask_mismatches(rows: list[dict], masks: list[list[int]], max_length: int) -> list[str]:
    """For each kept row whose prepared loss mask is not :func:`generated_mask`: the
    sample, the positions its mask covers and those the server generated."""
    mismatches = []
    for row, mask in zip(rows, masks, strict=True):
        expected = generated_mask(row, max_length)
        if expected is None:
            mismatches.append(f"{row['id']}: its metadata.usage has no prompt_tokens and completion_tokens to check the mask against")
        elif list(mask) != expected:
            mismatches.append(f"{row['id']}: masks positions {masked_span(mask)}, the server generated {masked_span(expected)}")
    return mismatches
