"""Stage 1: read user conversations, normalise, deduplicate and sample them.

A prompt file is read as users download them: JSONL, one JSON array (streamed:
ShareGPT's 640 MB file is not loaded whole), parquet, or a folder a ``datasets``
``save_to_disk`` wrote. Each row is a conversation in one of the common
layouts (``normalize_turns``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROLE_ALIASES = {"user": "user", "human": "user", "system": "system"}
SAFE_ID = re.compile(r"[^A-Za-z0-9._-]+")


class BadPromptRow(ValueError):
    """A prompt row that cannot be used; the message names file and line."""


@dataclass
class PromptStats:
    rows_read: int = 0
    bad_rows: int = 0
    duplicates: int = 0
    duplicate_ids_renamed: int = 0
    unique: int = 0
    sampled: int = 0
    bad_row_reasons: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {
            "rows_read": self.rows_read,
            "bad_rows": self.bad_rows,
            "bad_row_reasons": dict(self.bad_row_reasons),
            "duplicates": self.duplicates,
            "duplicate_ids_renamed": self.duplicate_ids_renamed,
            "unique": self.unique,
            "sampled": self.sampled,
        }


# Single-question layouts (Alpaca, GSM8K, MATH, HumanEval-style sets): the field that holds it.
QUESTION_FIELDS = ("prompt", "question", "instruction", "problem")


def row_turns(row: dict) -> list:
    """A row's turns in any of the layouts read: OpenAI ``messages``, ShareGPT
    ``conversations`` (``from``/``value``), MT-Bench ``turns`` (the user's, as
    strings), or one question (QUESTION_FIELDS; Alpaca's ``input`` appended)."""
    turns = row.get("messages") or row.get("conversations")
    if turns is None and isinstance(row.get("turns"), list):
        turns = [{"role": "user", "content": text} for text in row["turns"]]
    if turns is None and (field := next((f for f in QUESTION_FIELDS if isinstance(row.get(f), str)), None)):
        extra = row.get("input") if isinstance(row.get("input"), str) and row["input"].strip() else None
        turns = [{"role": "user", "content": row[field] + (f"\n\n{extra}" if extra else "")}]
    if not isinstance(turns, list) or not turns:
        layouts = ", ".join(f"'{name}'" for name in ("messages", "conversations", "turns", *QUESTION_FIELDS))
        raise ValueError(f"no conversation: none of {layouts} (or it is empty)")
    return turns


def normalize_turns(row: dict) -> list[dict]:
    """System and user turns of a row (``row_turns``).

    Assistant turns are dropped: the target model regenerates them.
    """
    turns = row_turns(row)
    kept = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise ValueError(f"turn is not an object: {turn!r:.60}")
        role = ROLE_ALIASES.get(turn.get("role") or turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if role and isinstance(content, str) and content.strip():
            kept.append({"role": role, "content": content})
    if not any(turn["role"] == "user" for turn in kept):
        raise ValueError("no user turn with text")
    return kept


def content_hash(turns: list[dict]) -> str:
    payload = json.dumps(turns, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()


def safe_sample_id(raw_id: object, digest: str) -> str:
    """An id that is safe as a file name; falls back to the content hash."""
    text = SAFE_ID.sub("_", str(raw_id)).strip("._")[:80] if raw_id else ""
    return text or f"h{digest[:16]}"


def jsonl_rows(path: Path) -> Iterator[tuple[str, Callable[[], object]]]:
    with path.open("rb") as lines:
        for line_number, raw in enumerate(lines, start=1):
            if raw.strip():
                yield f"line {line_number}", lambda raw=raw: json.loads(raw.decode("utf-8"))


MAX_ELEMENT_CHARS = 64 << 20  # an element longer than this is taken for broken JSON


def failing(error: ValueError) -> Callable[[], object]:
    def read():
        raise error

    return read


def json_array_rows(
    path: Path, chunk: int = 1 << 20, max_element_chars: int = MAX_ELEMENT_CHARS
) -> Iterator[tuple[str, Callable[[], object]]]:
    """The elements of a file holding one JSON array, decoded one at a time from
    ``chunk``-sized reads (the whole file is never in memory). A file that ends
    inside an element (a cut download) has that element as its last, bad row."""
    decoder = json.JSONDecoder()
    with path.open(encoding="utf-8") as stream:
        buffer, position, at_end, element = stream.read(chunk).lstrip(), 1, False, 0
        if not buffer.startswith("["):
            raise BadPromptRow(f"{path}: not a JSON array (a .json prompt file holds one array of conversations)")
        while True:
            while position < len(buffer) and buffer[position] in " \t\r\n,":
                position += 1
            if position < len(buffer) and buffer[position] == "]":
                return
            try:
                value, end = decoder.raw_decode(buffer, position)
                complete = end < len(buffer) or at_end  # a value cut by the chunk's end may still decode
            except json.JSONDecodeError as error:
                if at_end:
                    yield f"element {element + 1}", failing(ValueError(f"the file ends inside it (cut short?): {error}"))
                    return
                if len(buffer) - position > max_element_chars:  # past a syntax error no next element can be found
                    raise BadPromptRow(
                        f"{path}, element {element + 1}: not valid JSON within {max_element_chars:,} "
                        f"characters ({error}). Fix the file's JSON."
                    ) from error
                complete = False
            if complete:
                element += 1
                yield f"element {element}", lambda value=value: value
                position = end
                continue
            more = stream.read(chunk)
            at_end = not more
            buffer, position = buffer[position:] + more, 0


def parquet_rows(path: Path) -> Iterator[tuple[str, Callable[[], object]]]:
    import pyarrow.parquet as parquet  # a datasets dependency; only here: the plan runs without it

    row = 0
    for batch in parquet.ParquetFile(path).iter_batches(batch_size=1024):
        for value in batch.to_pylist():
            row += 1
            yield f"row {row}", lambda value=value: value


def saved_dataset_rows(path: Path) -> Iterator[tuple[str, Callable[[], object]]]:
    """The rows of a folder ``datasets``' ``save_to_disk`` wrote (a DatasetDict: its
    ``train`` split)."""
    from datasets import DatasetDict, load_from_disk

    dataset = load_from_disk(str(path))
    if isinstance(dataset, DatasetDict):
        if "train" not in dataset:
            raise BadPromptRow(f"{path}: a dataset of splits {sorted(dataset)} without 'train'; save the split to read")
        dataset = dataset["train"]
    for row, value in enumerate(dataset.with_format(None), start=1):
        yield f"row {row}", lambda value=value: value


def prompt_rows(path: Path) -> Iterator[tuple[str, Callable[[], object]]]:
    """``(where, read)`` for each row of a prompt file: ``read()`` decodes it (and may
    raise, for that row only)."""
    if path.is_dir():
        return saved_dataset_rows(path)
    readers = {".json": json_array_rows, ".parquet": parquet_rows}
    return readers.get(path.suffix, jsonl_rows)(path)


def read_prompt_file(path: Path, on_bad_row: str, stats: PromptStats):
    """Yield ``(sample_id, digest, turns)`` for each usable row of a prompt file."""
    for where, read in prompt_rows(path):
        stats.rows_read += 1
        try:
            row = read()
            if not isinstance(row, dict):
                raise ValueError("the row is not a JSON object")
            turns = normalize_turns(row)
        except (UnicodeDecodeError, ValueError) as error:
            reason = f"{path}, {where}: {error}"
            if on_bad_row == "fail":
                raise BadPromptRow(
                    f"{reason}. Fix the row, or set data.on_bad_row: skip "
                    "to skip bad rows (they are counted in prompts/stats.json)."
                ) from error
            stats.bad_rows += 1
            stats.bad_row_reasons[str(error).split(":")[0]] += 1
            continue
        digest = content_hash(turns)
        yield safe_sample_id(row.get("id") or row.get("uuid"), digest), digest, turns


def sample_rank(seed: int, digest: str) -> str:
    """Sampling key: taking the lowest N ranks keeps samples stable as N grows."""
    return hashlib.sha256(f"{seed}:{digest}".encode()).hexdigest()


def select_prompts(
    paths: list[Path], num_samples: int, seed: int, on_bad_row: str
) -> tuple[list[dict], PromptStats]:
    """Deduplicated conversations from ``paths``, ``num_samples`` of them."""
    stats = PromptStats()
    by_digest: dict[str, dict] = {}
    owner_of_id: dict[str, str] = {}
    for path in paths:
        for sample_id, digest, turns in read_prompt_file(path, on_bad_row, stats):
            if digest in by_digest:
                stats.duplicates += 1
                continue
            if sample_id in owner_of_id:
                stats.duplicate_ids_renamed += 1
                sample_id = f"{sample_id}-{digest[:8]}"
            owner_of_id[sample_id] = digest
            by_digest[digest] = {"id": sample_id, "messages": turns}
    stats.unique = len(by_digest)
    ranked = sorted(by_digest, key=lambda digest: sample_rank(seed, digest))
    chosen = sorted((by_digest[d] for d in ranked[:num_samples]), key=lambda r: r["id"])
    stats.sampled = len(chosen)
    return chosen, stats
