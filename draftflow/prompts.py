"""Stage 1: read user conversations, normalise, deduplicate, mix and sample them.

A prompt file is read as users download them: JSONL, one JSON array (streamed:
ShareGPT's 640 MB file is not loaded whole), parquet, or a folder a ``datasets``
``save_to_disk`` wrote (``draftflow.prompt_sources`` finds a source's files: a path,
a hub dataset in the local cache, a file inside a package). Each row is a
conversation in one of the common layouts (``normalize_turns``).

The training samples are mixed from the sources by count and weight (``mix``); the
evaluation sets' conversations follow them in the output, none of them a training
sample (``select_prompts`` refuses one by name), each set's sample ids and
categories listed in ``evaluation_sets.json``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from draftflow.prompt_sources import PromptSource, PromptSourceError, config_sources

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


def saved_dataset_rows(path: Path, split: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """The rows of a folder ``datasets``' ``save_to_disk`` wrote (a DatasetDict: its ``split``)."""
    from datasets import DatasetDict, load_from_disk

    dataset = load_from_disk(str(path))
    if isinstance(dataset, DatasetDict):
        if split not in dataset:
            raise BadPromptRow(f"{path}: a dataset of splits {sorted(dataset)} without {split!r}; set the source's split")
        dataset = dataset[split]
    for row, value in enumerate(dataset.with_format(None), start=1):
        yield f"row {row}", lambda value=value: value


def json_rows(path: Path) -> Iterator[tuple[str, Callable[[], object]]]:
    """A ``.json`` file: one array, or JSON Lines under that suffix (as many hub datasets ship)."""
    with path.open("rb") as start:
        first = start.read(4096).lstrip()[:1]
    return json_array_rows(path) if first == b"[" else jsonl_rows(path)


def prompt_rows(path: Path, split: str = "train") -> Iterator[tuple[str, Callable[[], object]]]:
    """``(where, read)`` for each row of a prompt file: ``read()`` decodes it (and may
    raise, for that row only)."""
    if path.is_dir():
        return saved_dataset_rows(path, split)
    readers = {".json": json_rows, ".parquet": parquet_rows}
    return readers.get(path.suffix, jsonl_rows)(path)


def source_rows(source: PromptSource) -> Iterator[tuple[str, Callable[[], object]]]:
    """``(where, read)`` for each row of a source's files."""
    for file in source.files:
        for where, read in prompt_rows(Path(file), source.split):
            yield f"{file}, {where}", read


@dataclass(frozen=True)
class Candidate:
    sample_id: str
    digest: str
    turns: list[dict]
    category: str | None
    where: str


def read_source(source: PromptSource, on_bad_row: str, stats: PromptStats) -> Iterator[Candidate]:
    """Each usable row of a source, bad ones counted in ``stats`` or failing the stage."""
    for where, read in source_rows(source):
        stats.rows_read += 1
        try:
            row = read()
            if not isinstance(row, dict):
                raise ValueError("the row is not a JSON object")
            turns = normalize_turns(row)
        except (UnicodeDecodeError, ValueError) as error:
            reason = f"{where}: {error}"
            if on_bad_row == "fail":
                raise BadPromptRow(
                    f"{reason}. Fix the row, or set data.on_bad_row: skip "
                    "to skip bad rows (they are counted in prompts/stats.json)."
                ) from error
            stats.bad_rows += 1
            stats.bad_row_reasons[str(error).split(":")[0]] += 1
            continue
        digest = content_hash(turns)
        raw_id = row.get("id") or row.get("uuid") or row.get("question_id")
        category = row.get(source.category_field)
        yield Candidate(safe_sample_id(raw_id, digest), digest, turns, str(category) if category else None, where)


def unique_rows(
    source: PromptSource, on_bad_row: str, stats: PromptStats, seen: dict[str, str], ids: set[str], id_prefix: str = ""
) -> list[Candidate]:
    """A source's conversations not read before (``seen``: digest → sample id), ids made unique in ``ids``."""
    kept = []
    for candidate in read_source(source, on_bad_row, stats):
        if candidate.digest in seen:
            stats.duplicates += 1
            continue
        sample_id = id_prefix + candidate.sample_id
        if sample_id in ids:
            stats.duplicate_ids_renamed += 1
            sample_id = f"{sample_id}-{candidate.digest[:8]}"
        ids.add(sample_id)
        seen[candidate.digest] = sample_id
        kept.append(Candidate(sample_id, candidate.digest, candidate.turns, candidate.category, candidate.where))
    stats.unique = len(kept)
    return kept


def sample_rank(seed: int, digest: str) -> str:
    """Sampling key: taking the lowest N ranks keeps samples stable as N grows."""
    return hashlib.sha256(f"{seed}:{digest}".encode()).hexdigest()


def lowest_ranked(candidates: list[Candidate], count: int | None, seed: int) -> list[Candidate]:
    return sorted(candidates, key=lambda c: sample_rank(seed, c.digest))[:count]


def weighted_shares(total: int, weights: list[float], available: list[int]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainders), no share above what is
    ``available``: a share a group cannot fill goes to the others."""
    shares, open_groups = [0] * len(weights), {i for i, w in enumerate(weights) if w > 0}
    while open_groups and total > 0:
        weight_sum = sum(weights[i] for i in open_groups)
        exact = {i: total * weights[i] / weight_sum for i in open_groups}
        if short := [i for i in open_groups if available[i] <= exact[i]]:
            for i in short:
                shares[i], total = available[i], total - available[i]
                open_groups.remove(i)
            continue
        floors = {i: int(exact[i]) for i in open_groups}
        by_remainder = sorted(open_groups, key=lambda i: (floors[i] - exact[i], i))
        for rank, i in enumerate(by_remainder):
            shares[i] = floors[i] + (rank < total - sum(floors.values()))
        break
    return shares


def mix(sources: list[PromptSource], rows: list[list[Candidate]], num_samples: int, seed: int) -> list[list[Candidate]]:
    """The conversations each source gives: a ``count`` exactly (or all it has), the rest of
    ``num_samples`` shared by ``weight``; sources with neither are pooled, sampled over their
    union, the pool weighing 1."""
    counted = sum(source.count for source in sources if source.count is not None)
    if counted > num_samples:
        raise PromptSourceError(f"data.prompt_files: the counts add up to {counted}, more than data.num_samples {num_samples}")
    chosen = [lowest_ranked(r, s.count, seed) if s.count is not None else [] for s, r in zip(sources, rows, strict=True)]
    pooled = [i for i, s in enumerate(sources) if s.count is None and s.weight is None]
    groups = [[i] for i, s in enumerate(sources) if s.weight is not None] + ([pooled] if pooled else [])
    weights = [sources[g[0]].weight if sources[g[0]].weight is not None else 1.0 for g in groups]
    members = [[c for i in group for c in rows[i]] for group in groups]
    shares = weighted_shares(num_samples - counted, weights, [len(m) for m in members])
    source_of = {c.digest: i for i, candidates in enumerate(rows) for c in candidates}
    for candidates, share in zip(members, shares, strict=True):
        for candidate in lowest_ranked(candidates, share, seed):
            chosen[source_of[candidate.digest]].append(candidate)
    return chosen


@dataclass
class Selection:
    rows: list[dict]  # the training samples, then the evaluation sets'
    stats: dict
    evaluation_sets: dict  # name → origin and sample id → category


def overlap_error(evaluation_set: PromptSource, candidate: Candidate, training_id: str) -> BadPromptRow:
    return BadPromptRow(
        f"evaluate.datasets {evaluation_set.name!r} ({candidate.where}): this conversation is also training "
        f"sample {training_id}: a drafter trained on an evaluation set's conversations overstates its "
        "acceptance there. Remove it from the training prompts (data.prompt_files), or the set from evaluate.datasets."
    )


def select_prompts(
    sources: list[PromptSource], num_samples: int, seed: int, on_bad_row: str, evaluation: list[PromptSource] = ()
) -> Selection:
    """Deduplicated training conversations from ``sources``, ``num_samples`` of them mixed as
    ``mix`` says, and the evaluation sets' conversations, none of them a training sample's."""
    seen, ids, per_source = {}, set(), {}
    rows = []
    for source in sources:
        stats = per_source[source.name] = PromptStats()
        rows.append(unique_rows(source, on_bad_row, stats, seen, ids))
    chosen = mix(sources, rows, num_samples, seed)
    training = {c.digest: c.sample_id for group in chosen for c in group}
    for source, group in zip(sources, chosen, strict=True):
        per_source[source.name].sampled = len(group)
    evaluation_rows, per_set, sets = [], {}, {}
    seen = {}
    for evaluation_set in evaluation:
        stats = per_set[evaluation_set.name] = PromptStats()
        unique = unique_rows(evaluation_set, on_bad_row, stats, seen, ids, id_prefix=f"{evaluation_set.name}-")
        taken = lowest_ranked(unique, evaluation_set.count, seed)
        for candidate in taken:
            if candidate.digest in training:
                raise overlap_error(evaluation_set, candidate, training[candidate.digest])
        stats.sampled = len(taken)
        evaluation_rows += sorted(taken, key=lambda c: c.sample_id)
        sets[evaluation_set.name] = {"origin": evaluation_set.origin, "samples": {c.sample_id: c.category for c in taken}}
    training_rows = sorted((c for group in chosen for c in group), key=lambda c: c.sample_id)
    records = [{"id": c.sample_id, "messages": c.turns} for c in training_rows + evaluation_rows]
    return Selection(records, selection_stats(sources, per_source, evaluation, per_set, sets), sets)


def selection_stats(sources, per_source, evaluation, per_set, sets) -> dict:
    totals = PromptStats()
    for stats in per_source.values():
        for name in ("rows_read", "bad_rows", "duplicates", "duplicate_ids_renamed", "unique", "sampled"):
            setattr(totals, name, getattr(totals, name) + getattr(stats, name))
        totals.bad_row_reasons.update(stats.bad_row_reasons)
    mixing = {s.name: {"origin": s.origin, "count": s.count, "weight": s.weight} for s in sources}
    return {
        **totals.as_dict(),
        "sources": {name: {**mixing[name], **stats.as_dict()} for name, stats in per_source.items()},
        "evaluation_sets": {
            s.name: {"origin": s.origin, **per_set[s.name].as_dict(),
                     "categories": dict(Counter(c or "all" for c in sets[s.name]["samples"].values()))}
            for s in evaluation
        },
    }  # fmt: skip


def config_selection(config: dict, base: Path = Path()) -> Selection:
    """What the prompts stage selects for ``config``, its paths taken from ``base``."""
    training, evaluation = config_sources(config, base)
    data = config["data"]
    return select_prompts(training, data["num_samples"], config["seed"], data["on_bad_row"], evaluation)
