"""Stage 2's answers checked for what a target served wrong leaves in them.

A checkpoint without its output head, weights in the wrong dtype or a chat template
other than the model's give no error: the server answers, and every answer is one
token repeated, a short loop, empty, or the same whatever the prompt. Answers cut at
``generate.max_tokens`` teach the drafter text that never ends. Each answer record is
checked on its token ids; too many flawed answers fail generation, naming the worst.
"""

from __future__ import annotations

from collections import Counter, defaultdict

CUT = "cut at generate.max_tokens"
EMPTY = "empty"
ONE_TOKEN = "one token repeated"
LOOP = "a short loop filling most of it"
SAME = "the same answer as another conversation's, to a different prompt"
LIKELY_CAUSES = {
    CUT: "answers longer than generate.max_tokens: raise it (and vllm.max_model_len)",
    EMPTY: "a chat template other than the model's, or an end-of-turn token the model emits at once",
    ONE_TOKEN: "a target served wrong: weights without their output head, the wrong target.dtype, or a template "
    "other than the model's",
    LOOP: "greedy decoding of a weak or mis-served target: check the target, or raise generate.temperature",
    SAME: "a chat template that leaves the prompt out, or a target that ignores it",
}
MIN_TOKENS_FOR_REPEATS = 8  # shorter answers ("Yes.") may repeat a token or another answer honestly
ONE_TOKEN_SHARE = 0.8
LOOP_SHARE, MAX_LOOP_PERIOD, MIN_LOOP_REPEATS = 0.5, 16, 3
SHOWN_SAMPLES, SHOWN_CHARS = 5, 160


def answer_ids(row: dict) -> list[int]:
    return [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]


def prompt_ids(row: dict) -> tuple[int, ...]:
    return tuple(t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if not m)


def loop_share(ids: list[int]) -> float:
    """The share of ``ids`` that the longest stretch repeating with a short period covers
    (a period of at most MAX_LOOP_PERIOD tokens, repeated at least MIN_LOOP_REPEATS times)."""
    best = 0.0
    for period in range(1, MAX_LOOP_PERIOD + 1):
        run = longest = 0
        for i in range(period, len(ids)):
            run = run + 1 if ids[i] == ids[i - period] else 0
            longest = max(longest, run)
        if longest >= MIN_LOOP_REPEATS * period:
            best = max(best, (longest + period) / len(ids))
    return best


def conversation_of(row: dict) -> str:
    """The conversation a row answers a turn of (speculators' client keeps it as ``primary_id``)."""
    return row.get("primary_id", row["id"])


def answered_elsewhere(rows: list[dict]) -> set[str]:
    """Ids of the rows whose answer a row of another conversation, asked another prompt,
    got too: two turns of one conversation may honestly be answered alike, and so may
    one prompt asked twice."""
    alike = defaultdict(list)
    for row in rows:
        alike[tuple(answer_ids(row))].append((row["id"], conversation_of(row), prompt_ids(row)))
    found = set()
    for group in alike.values():
        conversations, prompts = Counter(c for _, c, _ in group), Counter(p for _, _, p in group)
        both = Counter((c, p) for _, c, p in group)
        # the others in the group, less those of this conversation or this prompt
        found |= {i for i, c, p in group if len(group) - conversations[c] - prompts[p] + both[c, p] > 0}
    return found


def answer_flaws(rows: list[dict], max_tokens: int) -> dict[str, list[str]]:
    """Row id -> its flaws, for the rows that have any."""
    elsewhere = answered_elsewhere(rows)
    flaws = {}
    for row in rows:
        ids = answer_ids(row)
        repeats_count = len(ids) >= MIN_TOKENS_FOR_REPEATS
        found = [
            flaw
            for flaw, present in (
                (CUT, len(ids) >= max_tokens),
                (EMPTY, not ids),
                (ONE_TOKEN, repeats_count and Counter(ids).most_common(1)[0][1] >= ONE_TOKEN_SHARE * len(ids)),
                (LOOP, repeats_count and loop_share(ids) >= LOOP_SHARE),
                (SAME, repeats_count and row["id"] in elsewhere),
            )
            if present
        ]
        if found:
            flaws[row["id"]] = found
    return flaws


def flaw_stats(flaws: dict[str, list[str]]) -> dict:
    return {"flawed_answers": len(flaws), "answer_flaws": dict(Counter(f for found in flaws.values() for f in found))}


class FlawedAnswers(RuntimeError):
    pass


def check_answers(
    rows: list[dict], flaws: dict[str, list[str]], decode, max_fraction: float, limit: str, counted: str
) -> None:
    """Fail when more than ``max_fraction`` (the setting ``limit``) of the answers are
    flawed, naming the worst samples (most flaws first) with their text, and the likely
    causes; ``counted`` says which answers these are and where they are kept."""
    if len(flaws) <= max_fraction * len(rows):
        return
    by_id = {row["id"]: row for row in rows}
    worst = sorted(flaws, key=lambda row_id: (-len(flaws[row_id]), row_id))[:SHOWN_SAMPLES]
    shown = "\n".join(
        f"  {row_id} ({', '.join(flaws[row_id])}): {decode(answer_ids(by_id[row_id]))[:SHOWN_CHARS]!r}" for row_id in worst
    )
    causes = "\n".join(f"  {flaw}: {LIKELY_CAUSES[flaw]}" for flaw in sorted({f for row_id in flaws for f in flaws[row_id]}))
    raise FlawedAnswers(
        f"{len(flaws)} of {len(rows)} answers are flawed (more than {limit}={max_fraction:g}; {counted}). "
        f"The worst:\n{shown}\nLikely causes:\n{causes}\n"
        "The answers stay in the answer store, nothing computed is lost. A target whose answers loop by "
        "design (random weights) sets generate.max_degenerate_fraction: 1."
    )
