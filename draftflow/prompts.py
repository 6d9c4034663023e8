"""Stage 1: read user conversations, normalise, deduplicate and sample them."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
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


def normalize_turns(row: dict) -> list[dict]:
    """System and user turns of an OpenAI ``messages`` or ShareGPT row.

    Assistant turns are dropped: the target model regenerates them.
    """
    turns = row.get("messages") or row.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise ValueError("no 'messages' or 'conversations' list (or it is empty)")
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


def read_prompt_file(path: Path, on_bad_row: str, stats: PromptStats):
    """Yield ``(sample_id, digest, turns)`` for each usable row of a JSONL file."""
    with path.open("rb") as lines:
        for line_number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            stats.rows_read += 1
            try:
                row = json.loads(raw.decode("utf-8"))
                if not isinstance(row, dict):
                    raise ValueError("line is not a JSON object")
                turns = normalize_turns(row)
            except (UnicodeDecodeError, ValueError) as error:
                reason = f"{path}, line {line_number}: {error}"
                if on_bad_row == "fail":
                    raise BadPromptRow(
                        f"{reason}. Fix the row, or set data.on_bad_row: skip "
                        "to skip bad rows (they are counted in prompts/stats.json)."
                    ) from error
                stats.bad_rows += 1
                stats.bad_row_reasons[type(error).__name__] += 1
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
