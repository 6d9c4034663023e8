"""The answer store: every answer generation got, found by what was asked.

``results/<run>/synthetic/work/answers-<key>.jsonl`` holds speculators' client
rows for one target and one set of generation settings (``<key>``), each asked
under its conversation's content key (``conversation_key``) instead of its id;
``answers-<key>.errors.jsonl`` beside it holds the client's errors. Standard
library only: the plan reads it too.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from draftflow.fingerprint import target_fingerprint
from draftflow.prompts import content_hash
from draftflow.server_flags import keyed_server_flags


def iter_complete_lines(path: Path) -> Iterator[dict]:
    """Rows of a JSONL file that a writer may be appending to: a last line without
    its newline is not yet a row."""
    if not path.exists():
        return
    with path.open("rb") as stream:
        for line in stream:
            if line.endswith(b"\n") and line.strip():
                yield json.loads(line)


class AppendedRows:
    """The rows a writer completes in a JSONL file after this object was made, read
    incrementally: each ``new()`` parses only the bytes appended since the last."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = complete_length(path)

    def new(self) -> list[dict]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as stream:
            stream.seek(self.offset)
            data = stream.read()
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]


def complete_length(path: Path, block: int = 1 << 16) -> int:
    """Bytes of ``path`` up to the end of its last complete line, read from its end."""
    if not path.exists():
        return 0
    with path.open("rb") as stream:
        end = stream.seek(0, 2)
        while end > 0:
            start = max(0, end - block)
            stream.seek(start)
            if (newline := stream.read(end - start).rfind(b"\n")) >= 0:
                return start + newline + 1
            end = start
    return 0


def generation_key(target: Path, server_args: list[str], max_tokens: int, temperature: float, seed: int) -> str:
    """The answer store's key (listed in draftflow.dependencies): the target (model,
    tokenizer, chat template, sampling defaults), the server's flags as they shape
    answers, and the sampling settings. No path: a copied or moved target or run
    folder finds its answers."""
    shaping = [target_fingerprint(target), keyed_server_flags(server_args), max_tokens, temperature, seed]
    return hashlib.sha256(json.dumps(shaping).encode()).hexdigest()[:16]


def answer_store(work_dir: Path, key: str) -> Path:
    """The answers of every conversation asked under the generation ``key``
    (``generation_key``) in any run of this folder, by each conversation's content
    (``conversation_key``): a rerun asks only the conversations it lacks, wherever
    they sit in the prompts now.

    It is not a declared output, so Snakemake keeps it when the job fails or the
    prompts change; another key uses another store.
    """
    return work_dir / f"answers-{key}.jsonl"


def other_stores(store: Path) -> list[Path]:
    """The answer stores beside ``store`` under other keys."""
    return sorted(path for path in store.parent.glob("answers-*.jsonl") if path.name.count(".") == 1 and path != store)


def conversation_key(conversation: dict) -> str:
    """What the target answers: the turns, not the id or the position."""
    return content_hash(conversation["messages"])


def unasked(conversations: list[dict], store: Path) -> list[dict]:
    """The conversations the store holds no answer for, under their key as id (the
    client keeps the id as each answer's ``primary_id``)."""
    answered = set(stored_answers(store))
    return [
        {**conversation, "id": key}
        for conversation in conversations
        if (key := conversation_key(conversation)) not in answered
    ]


def stored_answers(store: Path) -> dict[str, list[dict]]:
    """The store's rows by conversation key; a last line torn by a kill is skipped."""
    by_key: dict[str, list[dict]] = {}
    for row in iter_complete_lines(store):
        by_key.setdefault(row["primary_id"], []).append(row)
    return by_key


def stored_rows(by_key: dict[str, list[dict]], conversations: list[dict]) -> list[dict]:
    """The stored answers (``stored_answers``) to ``conversations``, as a run that asked
    exactly these would have written them: their ids and positions, not those they
    were asked under."""
    return [
        as_asked(row, conversation["id"], position)
        for position, conversation in enumerate(conversations)
        for row in by_key.get(conversation_key(conversation), [])
    ]


def as_asked(row: dict, conversation_id: str, position: int) -> dict:
    """A stored row (answer or error) under the id and position of the conversation now."""
    key = row.get("primary_id", row["id"])
    renamed = {**row, "id": conversation_id + row["id"][len(key):], "metadata": {**row["metadata"], "idx": position}}
    if "primary_id" in row:
        renamed["primary_id"] = conversation_id
    return renamed
