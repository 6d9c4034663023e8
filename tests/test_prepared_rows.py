"""prepare trains only on the tokens the server generated (issue 26): the mask check on
rows shaped as speculators' client writes them."""

from pathlib import Path

import pytest

from draftflow.prepare import check_masks
from draftflow.prepared_rows import generated_mask, mask_mismatches


def client_row(sample_id: str, prompt: int, answer: int) -> dict:
    """A row as `speculators regenerate-responses` writes it: the server's prompt ids
    (mask 0), then the ids it generated (mask 1), with its usage counts."""
    usage = {"prompt_tokens": prompt, "completion_tokens": answer, "total_tokens": prompt + answer}
    return {"id": sample_id, "input_ids": list(range(prompt + answer)), "loss_mask": [0] * prompt + [1] * answer,
            "metadata": {"finish_reason": "stop", "usage": usage}}  # fmt: skip


def test_the_clients_rows_pass_whole_and_truncated():
    rows = [client_row("a", 5, 7), client_row("b", 9, 3)]
    assert mask_mismatches(rows, [row["loss_mask"] for row in rows], max_length=64) == []
    assert generated_mask(rows[0], max_length=8) == [0] * 5 + [1] * 3
    assert mask_mismatches(rows, [row["loss_mask"][:8] for row in rows], max_length=8) == []


def test_a_mask_shifted_by_one_token_is_named_with_both_spans():
    row = client_row("shifted", 5, 7)
    shifted = [0] * 4 + [1] * 7 + [0]  # one token early: the template's last prompt token, not the answer's last
    assert mask_mismatches([row], [shifted], max_length=64) == ["shifted: masks positions 4-10, the server generated 5-11"]


def test_a_row_without_usage_counts_is_named():
    row = {**client_row("bare", 2, 2), "metadata": {"usage": {}}}
    assert mask_mismatches([row], [row["loss_mask"]], max_length=64) == [
        "bare: its metadata.usage has no prompt_tokens and completion_tokens to check the mask against"
    ]


def test_prepare_stops_naming_the_file_and_each_sample():
    rows = [client_row(f"s{i}", 3, 4) for i in range(8)]
    masks = [[0, 0, 0, 0, 1, 1, 1]] * 7 + [rows[7]["loss_mask"]]  # the first seven start one token late
    with pytest.raises(ValueError, match=r"generated\.jsonl: the loss mask of 7 of 8 rows .* s0: masks positions 4-6, "
                                         r"the server generated 3-6; .*; and 2 more\. .*generate them again"):  # fmt: skip
        check_masks(rows, masks, 64, Path("results/demo/synthetic/generated.jsonl"))
