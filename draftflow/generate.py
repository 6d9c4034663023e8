"""Stage 2: the target model answers the prompts (speculators' regenerate client)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import mean

from transformers import AutoTokenizer

from draftflow.io import iter_jsonl, write_json, write_jsonl


@dataclass(frozen=True)
class GenerationSettings:
    max_tokens: int
    temperature: float
    concurrency: int
    max_retries: int
    seed: int
    reasoning_end_marker: str


def regenerate(
    chat_url: str, conversations: Path, partial: Path, settings: GenerationSettings
) -> None:
    """Run speculators' client, appending to ``partial`` and resuming from it."""
    sampling = {"temperature": settings.temperature, "seed": settings.seed}
    command = [
        sys.executable, "-m", "speculators", "regenerate-responses",
        "--endpoint", chat_url,
        "--dataset", str(conversations),
        "--outfile", str(partial),
        "--resume",
        "--concurrency", str(settings.concurrency),
        "--max-tokens", str(settings.max_tokens),
        "--max-retries", str(settings.max_retries),
        "--sampling-params", json.dumps(sampling),
    ]  # fmt: skip
    subprocess.run(command, check=True)


def errors_path(partial: Path) -> Path:
    return partial.with_name(f"{partial.stem}.errors{partial.suffix}")


def completion_ids(row: dict) -> list[int]:
    return [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]


def generation_stats(
    rows: list[dict], errors: list[dict], tokenizer, end_marker: str, seconds: float
) -> dict:
    completions = [tokenizer.decode(completion_ids(row)) for row in rows]
    prompt_tokens = [row["loss_mask"].count(0) for row in rows]
    response_tokens = [row["loss_mask"].count(1) for row in rows]
    captured = sum(end_marker in text for text in completions)
    return {
        "samples": len(rows),
        "conversations": len({row["primary_id"] for row in rows}),
        "errors": len(errors),
        "truncated": sum(row["metadata"].get("finish_reason") == "length" for row in rows),
        "reasoning_capture_rate": captured / len(rows) if rows else 0.0,
        "mean_prompt_tokens": mean(prompt_tokens) if rows else 0.0,
        "mean_response_tokens": mean(response_tokens) if rows else 0.0,
        "response_tokens": sum(response_tokens),
        "wall_seconds": seconds,
        "response_tokens_per_second": sum(response_tokens) / seconds if seconds else 0.0,
    }


def finish(
    partial: Path,
    tokenizer_dir: str,
    settings: GenerationSettings,
    seconds: float,
    endpoint: str,
    output: Path,
    errors_output: Path,
    stats_output: Path,
) -> dict:
    """Write the rows sorted by id (completion order varies), errors and stats.

    ``endpoint`` replaces the URL the client recorded in each row: a local
    server's port is random and would make reruns differ.
    """
    rows = sorted(iter_jsonl(partial), key=lambda row: row["id"])
    for row in rows:
        row["metadata"]["endpoint"] = endpoint
    if not rows:
        raise RuntimeError(
            f"No conversation was answered; see {errors_path(partial)} for why."
        )
    errors = list(iter_jsonl(errors_path(partial))) if errors_path(partial).exists() else []
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    stats = generation_stats(rows, errors, tokenizer, settings.reasoning_end_marker, seconds)
    write_jsonl(errors_output, errors)
    write_json(stats_output, stats)
    write_jsonl(output, rows)
    return stats


def timed(function, *args) -> float:
    start = time.monotonic()
    function(*args)
    return time.monotonic() - start


def work_file(
    work_dir: Path, conversations: Path, target: str, settings: GenerationSettings
) -> Path:
    """The resumable partial output, keyed by everything that shapes its rows.

    It is not a declared output, so Snakemake keeps it when the job fails; a
    change of prompts, target or settings starts a fresh file.
    """
    key = hashlib.sha256()
    key.update(conversations.read_bytes())
    key.update(json.dumps([str(Path(target).resolve()), asdict(settings)]).encode())
    return work_dir / f"generated-{key.hexdigest()[:16]}.jsonl"
