"""The answer store: every answer generation got, found by what was asked.

``results/<run>/synthetic/work/answers-<key>.job-<s>.jsonl`` holds speculators'
client rows that generation job ``s`` got for one target and one set of generation
settings (``<key>``), each asked under its conversation's content key
(``conversation_key``) instead of its id; ``answers-<key>.job-<s>.errors.jsonl``
beside it holds the client's errors. The store of a key is all its files, whatever
the job count that wrote them (and ``answers-<key>.jsonl``, the one file of draftflow
before ``generate.servers``): a job asks only what none of them holds. Which job
asks a conversation follows from its key alone (``server_of``). Standard library
only: the plan reads it too.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

from draftflow.fingerprint import target_fingerprint
from draftflow.prompts import content_hash
from draftflow.sampling import set_fields
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


# what generation asks with beside max_tokens, the temperature and the seed; unset, not keyed
ASKED_WITH = ("sampling", "chat_template_kwargs", "system_prompt")


def generation_key(target: Path, server_args: list[str], settings: dict) -> str:
    """The answer store's key (listed in draftflow.dependencies): the target (model,
    tokenizer, chat template, sampling defaults), the server's flags as they shape
    answers, and generation's ``settings`` as they shape them (the rule's: max_tokens,
    temperature, seed and ASKED_WITH). No path: a copied or moved target or run folder
    finds its answers."""
    shaping = [target_fingerprint(target), keyed_server_flags(server_args), settings["max_tokens"],
               settings["temperature"], settings["seed"]]  # fmt: skip
    asked = {**settings, "sampling": set_fields(settings.get("sampling"))}
    asked_with = {name: value for name, value in asked.items() if name in ASKED_WITH and value}
    if asked_with:  # absent where unset: the answers of runs before these settings keep their key
        shaping.append(asked_with)
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:16]


def answer_store(work_dir: Path, key: str, server: int) -> Path:
    """The file generation job ``server`` appends the answers it gets under the
    generation ``key`` (``generation_key``) to, in any run of this folder.

    It is not a declared output, so Snakemake keeps it when the job fails or the
    prompts change; another key uses other files.
    """
    return work_dir / f"answers-{key}.job-{server}.jsonl"


JOB_RECORDS = "jobs"


def job_record(synthetic: str | Path, server: int | str) -> str:
    """Generation job ``server``'s record of its share (``generate.answer_share``), under
    the stage's folder: the job's output, which the gather reads."""
    return f"{synthetic}/{JOB_RECORDS}/job-{server}.json"


def job_records(synthetic: Path) -> list[Path]:
    """The generation jobs' records a run left, in job order."""
    return sorted((synthetic / JOB_RECORDS).glob("job-*.json"), key=lambda path: int(path.stem.split("-")[1]))


# answers-<key>.jsonl (before generate.servers) or answers-<key>.job-<s>.jsonl
STORE_FILE = re.compile(r"answers-(?P<key>[0-9a-f]+)(?:\.job-(?P<job>\d+))?\.jsonl")


def store_files(work_dir: Path, key: str) -> list[Path]:
    """The files holding answers under ``key``: the one-file store of an earlier
    draftflow first, then each job's in job order."""
    found = [(m, path) for path in work_dir.glob(f"answers-{key}*.jsonl") if (m := STORE_FILE.fullmatch(path.name))]
    return [path for m, path in sorted(found, key=lambda item: int(item[0]["job"] or -1)) if m["key"] == key]


def other_stores(work_dir: Path, key: str) -> list[str]:
    """The keys of the other answer stores in ``work_dir``."""
    keys = {m["key"] for path in work_dir.glob("answers-*.jsonl") if (m := STORE_FILE.fullmatch(path.name))}
    return sorted(keys - {key})


def server_of(key: str, servers: int) -> int:
    """The generation job that asks the conversation of content key ``key``, of
    ``servers``: the highest of a hash of the two (rendezvous hashing), so another
    job count moves only the conversations that the jobs added or removed win or
    held, and new conversations spread evenly."""
    return max(range(servers), key=lambda server: hashlib.sha256(f"{key}/{server}".encode()).digest())


def share(conversations: list[dict], server: int, servers: int) -> list[dict]:
    """The conversations generation job ``server`` of ``servers`` asks."""
    return [c for c in conversations if server_of(conversation_key(c), servers) == server]


def conversation_key(conversation: dict) -> str:
    """What the target answers: the turns, not the id or the position."""
    return content_hash(conversation["messages"])


def unasked(conversations: list[dict], answered: dict[str, list[dict]]) -> list[dict]:
    """The conversations without answers in ``answered`` (``stored_answers``), under
    their key as id (the client keeps the id as each answer's ``primary_id``)."""
    return [
        {**conversation, "id": key}
        for conversation in conversations
        if (key := conversation_key(conversation)) not in answered
    ]


def stored_answers(files: list[Path]) -> dict[str, list[dict]]:
    """The rows of a store's ``files`` (``store_files``) by conversation key; a last
    line torn by a kill is skipped. A conversation's rows come from one file (the
    first holding it): a job asks only what no file holds, so this is a guard."""
    by_key: dict[str, list[dict]] = {}
    for file in files:
        found: dict[str, list[dict]] = {}
        for row in iter_complete_lines(file):
            found.setdefault(row["primary_id"], []).append(row)
        by_key |= {key: rows for key, rows in found.items() if key not in by_key}
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
