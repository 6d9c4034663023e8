"""Stage 2: the target model answers the prompts (speculators' regenerate client)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean

from jinja2 import TemplateError
from transformers import AutoTokenizer

from draftflow.answer_checks import CUT, LIKELY_CAUSES, ONE_TOKEN, FlawedAnswers, answer_flaws, check_answers, flaw_stats
from draftflow.answers import (
    AppendedRows,
    answer_store,
    as_asked,
    conversation_key,
    other_stores,
    share,
    store_files,
    stored_answers,
    stored_rows,
    unasked,
)
from draftflow.auth_proxy import api_key_from_env, authenticating_proxy
from draftflow.chat_template import flag_value, generation_record, served_template
from draftflow.io import iter_jsonl, write_json, write_jsonl
from draftflow.sampling import request_fields, sampling_record, server_defaults
from draftflow.vllm_server import ServerGoneError, is_healthy, log_excerpt

LOST_TURNS_WARN_FRACTION = 0.05
# The first answers a run asks are checked as soon as they are written, so a target
# served wrong fails in minutes, not after the stage: only when most are flawed (a few
# of 32 vary by chance), or more than generate.max_degenerate_fraction where that is higher.
EARLY_ANSWERS, EARLY_FLAWED_SHARE = 32, 0.5


@dataclass(frozen=True)
class GenerationSettings:
    max_tokens: int
    temperature: float
    concurrency: int
    max_retries: int
    seed: int
    reasoning_end_marker: str
    max_error_fraction: float
    max_degenerate_fraction: float
    sampling: dict = field(default_factory=dict)  # generate.sampling: null fields are the server's
    chat_template_kwargs: dict = field(default_factory=dict)
    system_prompt: str | None = None

    def request(self) -> dict:
        """The sampling fields every chat request carries."""
        return request_fields(self.temperature, self.seed, self.sampling, self.chat_template_kwargs)


def regenerate(
    base_url: str,
    conversations: Path,
    partial: Path,
    settings: GenerationSettings,
    check_early: Callable[[], None],
    server_log: Path | None = None,
) -> None:
    """Run speculators' client, appending to ``partial`` and resuming from it.

    ``server_log`` marks a server draftflow started: it is watched meanwhile, and
    once it has been down longer than the client's retries with backoff last,
    the client is stopped and the rule fails, rather than every remaining
    conversation failing into the errors file and counting against the budget.
    """
    drop_torn_last_line(partial)
    server_up = (lambda: is_healthy(base_url)) if server_log else (lambda: True)
    command = client_command(f"{base_url}/v1/chat/completions", conversations, partial, settings)
    with subprocess.Popen(command) as client:
        try:
            server_stayed = client_finished(client, server_up, retry_window_s(settings.max_retries), check_early)
        finally:
            client.kill()  # a no-op once it ended; on SIGTERM it must not outlive the rule
    if not server_stayed:
        drop_torn_last_line(partial)
        answered = len({row["primary_id"] for row in iter_jsonl(partial)}) if partial.exists() else 0
        raise ServerGoneError(
            f"The vLLM server at {base_url} died during generation: it stayed down past the "
            f"client's retries with backoff (generate.max_retries={settings.max_retries}). The "
            f"{answered} conversations answered so far are kept in {partial}; rerun to ask "
            f"only the others. {log_excerpt(server_log, 10)}"
        )
    if client.returncode:
        raise subprocess.CalledProcessError(client.returncode, client.args)


def client_command(
    chat_url: str, conversations: Path, partial: Path, settings: GenerationSettings
) -> list[str]:
    return [
        sys.executable, "-m", "speculators", "regenerate-responses",
        "--endpoint", chat_url,
        "--dataset", str(conversations),
        "--outfile", str(partial),
        "--resume",
        "--concurrency", str(settings.concurrency),
        "--max-tokens", str(settings.max_tokens),
        "--max-retries", str(settings.max_retries),
        "--sampling-params", json.dumps(settings.request()),
    ]  # fmt: skip


# speculators' client waits RETRY_BACKOFF_BASE**attempt seconds before each retry
# (speculators.data_generation.vllm_client; a test holds the two equal). Not imported:
# the package's import costs a generate job 4 CPU-s more than the tokenizer's.
CLIENT_RETRY_BACKOFF_BASE = 2


def retry_window_s(max_retries: int) -> float:
    """How long the client's retries of one request wait in all (exponential backoff)."""
    return sum(CLIENT_RETRY_BACKOFF_BASE**attempt for attempt in range(1, max_retries + 1))


class EarlyAnswerCheck:
    """Checks the first EARLY_ANSWERS conversations this run asks, once they are answered
    (the answer store) or failed (its errors file): a target served wrong gives flawed
    answers, or none (an empty answer is an error to speculators' client)."""

    def __init__(self, store: Path, settings: GenerationSettings, tokenizer_dir: str):
        self.store, self.settings, self.tokenizer_dir = store, settings, tokenizer_dir
        self.appended = [AppendedRows(path) for path in (store, errors_path(store))]  # earlier runs checked theirs
        self.rows, self.errors = [], []
        self.checked = False

    def __call__(self) -> None:
        if self.checked:
            return
        rows, errors = (seen + appended.new() for seen, appended in zip((self.rows, self.errors), self.appended))
        self.rows, self.errors = rows, errors
        if len(rows) + len(errors) < EARLY_ANSWERS:
            return
        self.checked = True
        share = max(EARLY_FLAWED_SHARE, self.settings.max_degenerate_fraction)
        if len(errors) > share * (len(rows) + len(errors)):
            reason, count = Counter(e["metadata"].get("error", "?") for e in errors).most_common(1)[0]
            raise FlawedAnswers(
                f"{len(errors)} of the first {len(rows) + len(errors)} conversations of this run failed ({count}: "
                f"{reason}; all in {errors_path(self.store)}). The server answers, but not usefully: "
                f"{LIKELY_CAUSES[ONE_TOKEN]}. Answers given so far stay in {self.store}."
            )
        decode = AutoTokenizer.from_pretrained(self.tokenizer_dir).decode
        counted = f"the first {len(rows)} answers of this run, kept in {self.store}"
        check_answers(rows, answer_flaws(rows, self.settings.max_tokens), decode, share, "the early check's share", counted)


def client_finished(
    client: subprocess.Popen, server_up: Callable[[], bool], patience_s: float, check_early: Callable[[], None]
) -> bool:
    """Wait for the client to end, checking its first answers; False as soon as the
    server has been down for ``patience_s``, or is down when the client ends."""
    down_since = None
    while client.poll() is None:
        check_early()
        if server_up():
            down_since = None
        elif down_since is None:
            down_since = time.monotonic()
        elif time.monotonic() - down_since > patience_s:
            return False
        time.sleep(1)
    return server_up()


def drop_torn_last_line(path: Path) -> None:
    """Cut a last line that a kill left without its newline: appending after it
    would glue the next row onto it and lose both."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("rb+") as stream:
        data = stream.read()
        if not data.endswith(b"\n"):
            stream.truncate(data.rfind(b"\n") + 1)


def errors_path(partial: Path) -> Path:
    return partial.with_name(f"{partial.stem}.errors{partial.suffix}")


def completion_ids(row: dict) -> list[int]:
    return [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]


def generation_stats(rows: list[dict], errors: list[dict], tokenizer, end_marker: str, jobs: list[dict]) -> dict:
    """``jobs``: each generation job's record (``answer_share``); the throughput counts
    only what they asked (the other answers were stored by earlier runs)."""
    completions = [tokenizer.decode(completion_ids(row)) for row in rows]
    prompt_tokens = [row["loss_mask"].count(0) for row in rows]
    response_tokens = [row["loss_mask"].count(1) for row in rows]
    captured = sum(end_marker in text for text in completions)
    generated_now = sum(job["response_tokens_generated"] for job in jobs)
    server_seconds = sum(job["seconds"] for job in jobs)
    return {
        "samples": len(rows),
        "conversations": len({row["primary_id"] for row in rows}),
        "errors": len(errors),
        "reasoning_capture_rate": captured / len(rows) if rows else 0.0,
        "mean_prompt_tokens": mean(prompt_tokens) if rows else 0.0,
        "mean_response_tokens": mean(response_tokens) if rows else 0.0,
        "response_tokens": sum(response_tokens),
        "servers": len(jobs),
        "conversations_asked": sum(job["conversations_asked"] for job in jobs),
        "response_tokens_generated": generated_now,
        "server_seconds": server_seconds,
        "response_tokens_per_second": generated_now / server_seconds if server_seconds else 0.0,
    }


def lost_turn_stats(conversations: list[dict], rows: list[dict]) -> dict:
    """User turns that speculators' client never asked, over the answered conversations.

    The client answers a conversation's user turns in order, one row per answer
    (the prompts carry no tools, so there are no tool-call rows), and stops it
    once a turn's prompt + completion exceed ``max_tokens``: the user turns after
    that one are lost. A conversation without rows failed whole and is counted
    among the errors instead.
    """
    answers = Counter(row["primary_id"] for row in rows)
    user_turns = {
        conversation["id"]: sum(turn["role"] == "user" for turn in conversation["messages"])
        for conversation in conversations
        if conversation["id"] in answers
    }
    lost = [user_turns[conversation] - answers[conversation] for conversation in user_turns]
    return {
        "multi_turn_conversations": sum(turns > 1 for turns in user_turns.values()),
        "user_turns": sum(user_turns.values()),
        "user_turns_lost": sum(lost),
        "conversations_with_lost_turns": sum(turns > 0 for turns in lost),
    }


def lost_turns_warnings(stats: dict, max_tokens: int) -> list[str]:
    """A warning when more than LOST_TURNS_WARN_FRACTION of the conversations lost turns."""
    lost, conversations = stats["conversations_with_lost_turns"], stats["conversations"]
    if lost <= LOST_TURNS_WARN_FRACTION * conversations:
        return []
    return [
        f"{lost} of {conversations} conversations ({100 * lost / conversations:.1f}%, more "
        f"than {100 * LOST_TURNS_WARN_FRACTION:.0f}%) lost their later user turns "
        f"(user_turns_lost: {stats['user_turns_lost']}): speculators' client stops a "
        "conversation once a turn's prompt + completion exceed "
        f"generate.max_tokens={max_tokens}, and never asks the turns after it. Raise "
        "generate.max_tokens (with vllm.max_model_len) to keep them."
    ]


def answered(work_dir: Path, key: str, conversations: list[dict]) -> tuple[list[dict], list[dict]]:
    """The stored answers (every file of the key) to ``conversations``, sorted by id
    (completion order varies), and the errors of those left unanswered."""
    files = store_files(work_dir, key)
    rows = sorted(stored_rows(stored_answers(files), conversations), key=lambda row: row["id"])
    errors = unresolved_errors([errors_path(file) for file in files], conversations, {row["primary_id"] for row in rows})
    return rows, errors


def answer_share(
    conversations: Path,
    work_dir: Path,
    key: str,
    server: int,
    servers: int,
    settings: GenerationSettings,
    endpoint: Callable[[], AbstractContextManager[str]],
    server_log: Path | None,
    tokenizer_dir: str,
    output: Path,
    server_args: list[str] | None,
) -> dict:
    """Generation job ``server`` of ``servers``: ask the target its share of the
    conversations (``answers.share``) that no file of the store holds and that fit the
    server (``server_args``, None for an endpoint: ``PromptRoom``), into its own file,
    and record what it asked; the error budget holds for its share (the early check
    for its first answers). The degeneracy gate is the gather's (``finish``): a share's
    flawed fraction varies by chance around the whole's."""
    asked = share(list(iter_jsonl(conversations)), server, servers)
    label = f"generation job {server} of {servers}"
    room = PromptRoom.of_server(tokenizer_dir, server_args, settings) if server_args is not None else None
    seconds, asked_now, too_long = ask_unanswered(asked, work_dir, key, server, settings, endpoint, server_log, tokenizer_dir,
                                                  label, room)  # fmt: skip
    asked = [conversation for conversation in asked if conversation["id"] not in too_long]
    rows, errors = answered(work_dir, key, asked)
    errors, overflowed = split_errors(errors)
    record = {
        "server": server,
        "servers": servers,
        "conversations": len(asked),
        "too_long": sorted(too_long),
        "overflowed": len(overflowed),
        "answered": len({row["primary_id"] for row in rows}),
        "errors": len(errors),
        "conversations_asked": len(asked_now & {row["primary_id"] for row in rows}),
        "response_tokens_generated": sum(row["loss_mask"].count(1) for row in rows if row["primary_id"] in asked_now),
        "seconds": seconds,
    }
    write_json(output, record)
    check_error_rate(record["answered"], record["errors"], settings.max_error_fraction, errors_path(answer_store(work_dir, key, server)), label)
    return record


def finish(
    work_dir: Path,
    key: str,
    conversations: Path,
    jobs: list[dict],
    tokenizer_dir: str,
    settings: GenerationSettings,
    endpoint: str,
    server_args: list[str] | None,
    output: Path,
    errors_output: Path,
    stats_output: Path,
    evaluation_ids: set[str] = frozenset(),
) -> dict:
    """Gather the generation jobs' answers (``jobs``: their records): write the answers
    of ``conversations`` (but those the jobs found too long to ask) from every file of
    the store, sorted by id, as one job would have, their errors and stats (with the
    user turns lost to ``generate.max_tokens``, warned about in the log), and hold the
    error budget and the degeneracy gate over them all.

    ``endpoint`` replaces the URL the client recorded in each row: a local
    server's port is random and would make reruns differ. ``server_args``: the
    flags of the servers the jobs started (None: an endpoint's), which say the chat
    template it rendered with. ``evaluation_ids``: the conversations of evaluation sets, whose
    flawed answers are counted apart and fail nothing (generate.max_degenerate_fraction
    guards what the drafter trains on).
    """
    too_long = sorted(conversation for job in jobs for conversation in job["too_long"])
    never_asked = set(too_long)
    asked = [conversation for conversation in iter_jsonl(conversations) if conversation["id"] not in never_asked]
    rows, errors = answered(work_dir, key, asked)
    errors, overflowed = split_errors(errors)
    for row in rows:
        row["metadata"]["endpoint"] = endpoint
    errors_files = ", ".join(str(errors_path(file)) for file in store_files(work_dir, key))
    if not rows:
        raise RuntimeError(f"No conversation was answered; see {errors_files or work_dir} for why.")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    stats = generation_stats(rows, errors, tokenizer, settings.reasoning_end_marker, jobs)
    stats |= lost_turn_stats(asked, rows)
    # never asked, or refused in a later turn: no rerun answers them, so no budget counts them
    stats |= {"too_long": len(too_long), "too_long_ids": too_long, "overflowed": len(overflowed)}
    stats["chat_template"] = generation_record(tokenizer, tokenizer_dir, server_args)
    stats["sampling"] = sampling_record(settings.request(), server_defaults(Path(tokenizer_dir), server_args))
    print(f"Sampled with {stats['sampling']['effective']} (server defaults: {stats['sampling']['server_defaults']})")
    print(f"Prompts rendered with the chat template: {stats['chat_template']['source']}, sha256 {stats['chat_template']['sha256']}")
    training = [row for row in rows if row["primary_id"] not in evaluation_ids]
    flaws = answer_flaws(training, settings.max_tokens)
    stats |= flaw_stats(flaws) | {"truncated": sum(CUT in found for found in flaws.values())}
    # an evaluation set's answers are what the target says on that benchmark: counted, not gated
    evaluation_flaws = answer_flaws([row for row in rows if row["primary_id"] in evaluation_ids], settings.max_tokens)
    stats["evaluation_set_answers"] = {"answers": len(rows) - len(training), **flaw_stats(evaluation_flaws)}
    stats["warnings"] = lost_turns_warnings(stats, settings.max_tokens)
    for warning in stats["warnings"]:
        print(f"WARNING: {warning}")
    write_jsonl(errors_output, sorted(errors + overflowed, key=lambda error: error["id"]))
    write_json(stats_output, stats)
    check_error_rate(stats["conversations"], stats["errors"], settings.max_error_fraction, errors_files, "generation")
    limit, counted = "generate.max_degenerate_fraction", f"counts in {stats_output}"
    check_answers(training, flaws, tokenizer.decode, settings.max_degenerate_fraction, limit, counted)
    write_jsonl(output, rows)
    return stats


def unresolved_errors(files: list[Path], conversations: list[dict], answered: set[str]) -> list[dict]:
    """The latest error of each of ``conversations`` that no (re)run answered since,
    under the conversation's id (``files``: the store's errors files, in order)."""
    latest = {row["id"]: row for file in files if file.exists() for row in iter_jsonl(file)}
    errors = []  # keyed by conversation_key, as the client was asked
    for position, conversation in enumerate(conversations):
        error = latest.get(conversation_key(conversation))
        if error is not None and conversation["id"] not in answered:
            errors.append(as_asked(error, conversation["id"], position))
    return sorted(errors, key=lambda row: row["id"])


def check_error_rate(answered: int, errors: int, max_fraction: float, errors_file: Path | str, label: str) -> None:
    attempted = answered + errors
    if errors > max_fraction * attempted:
        raise RuntimeError(
            f"{label}: {errors} of {attempted} conversations failed (more than "
            f"generate.max_error_fraction={max_fraction}); their errors are in {errors_file}. "
            "Fix the cause (server log, endpoint) and rerun: answered conversations are kept "
            "and only the failed ones are asked again."
        )


def timed(function, *args) -> float:
    start = time.monotonic()
    function(*args)
    return time.monotonic() - start


def ask_unanswered(
    asked: list[dict],
    work_dir: Path,
    key: str,
    server: int,
    settings: GenerationSettings,
    endpoint: Callable[[], AbstractContextManager[str]],
    server_log: Path | None,
    tokenizer_dir: str,
    label: str,
    room: PromptRoom | None,
) -> tuple[float, set[str], set[str]]:
    """Ask the target only the conversations of ``asked`` that no file of the store of
    ``key`` answers and that fit ``room`` (None: not known), appending to job ``server``'s
    file (starting no server when there are none); the seconds generation took, the
    ids it asked and the ids of those too long to ask."""
    files, store = store_files(work_dir, key), answer_store(work_dir, key, server)
    todo = unasked(asked, stored_answers(files))
    dropped = room.too_long(todo) if room else set()
    too_long = {conversation["id"] for conversation in asked if conversation_key(conversation) in dropped}
    todo = [question for question in todo if question["id"] not in dropped]
    print(f"{label}: {len(asked)} conversations: {len(asked) - len(todo) - len(too_long)} answered before, "
          f"{len(todo)} to ask, {len(too_long)} too long for the server's context (never asked)")  # fmt: skip
    if too_long:
        print(f"  too long: {', '.join(sorted(too_long)[:SHOWN_TOO_LONG])}{' ...' if len(too_long) > SHOWN_TOO_LONG else ''} "
              f"(their first prompt leaves no token of vllm.max_model_len={room.max_model_len} to answer in)")
    if not files and (others := other_stores(work_dir, key)):
        print(
            f"{len(others)} other answer store(s) beside it ({', '.join(f'answers-{other}' for other in others)}) hold "
            "answers of another target, chat template, server flags or sampling settings (or of draftflow before it "
            f"keyed the chat template and the weights): kept, not used (this run's: answers-{key})"
        )
    if not todo:
        return 0.0, set(), too_long
    questions = store.with_name(f"{store.stem}.asking.jsonl")
    write_jsonl(questions, [with_system_prompt(conversation, settings.system_prompt) for conversation in todo])
    keys = {question["id"] for question in todo}
    check_early = EarlyAnswerCheck(store, settings, tokenizer_dir)
    with endpoint() as url:
        seconds = timed(regenerate, url, questions, store, settings, check_early, server_log)
    return seconds, {conversation["id"] for conversation in asked if conversation_key(conversation) in keys}, too_long


def with_system_prompt(conversation: dict, system_prompt: str | None) -> dict:
    """``conversation`` as it is asked: opened by ``system_prompt`` unless it has a system
    turn of its own (its key stays its own turns': the prompt is in generation's key)."""
    messages = conversation["messages"]
    if system_prompt is None or any(message["role"] == "system" for message in messages):
        return conversation
    return {**conversation, "messages": [{"role": "system", "content": system_prompt}, *messages]}


SHOWN_TOO_LONG = 5
# what vLLM says of a prompt longer than --max-model-len (HTTP 400), as the client records it
OVERFLOW = "maximum context length"


@dataclass(frozen=True)
class PromptRoom:
    """The room a conversation's first prompt must fit in: ``max_model_len`` tokens of a
    server rendering with ``template`` (None: the tokenizer's own), the prompt and one
    answer token. vLLM refuses a longer prompt however often it is asked."""

    tokenizer: object
    template: str | None
    max_model_len: int
    settings: GenerationSettings

    @classmethod
    def of_server(cls, tokenizer_dir: str, server_args: list[str], settings: GenerationSettings) -> PromptRoom:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        _, template = served_template(tokenizer, tokenizer_dir, flag_value(server_args))
        return cls(tokenizer, template, int(flag_value(server_args, "--max-model-len")), settings)

    def too_long(self, questions: list[dict]) -> set[str]:
        """The ids of ``questions`` whose first prompt leaves no token to answer in."""
        return {question["id"] for question in questions if not self.fits(question)}

    def fits(self, question: dict) -> bool:
        messages = with_system_prompt(question, self.settings.system_prompt)["messages"]
        first = messages[: next(i for i, message in enumerate(messages) if message["role"] == "user") + 1]
        try:
            text = self.tokenizer.apply_chat_template(first, chat_template=self.template, add_generation_prompt=True,
                                                      tokenize=False, **self.settings.chat_template_kwargs)  # fmt: skip
        except TemplateError:
            return True  # the server's template refuses it too: an error the server names, counted as such
        # a token holds a byte of the text at least (a word-start marker aside): only a
        # prompt near the room in bytes is tokenized, as vLLM tokenizes a rendered chat
        if len(text.encode()) + 2 <= self.max_model_len:
            return True
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + 1 <= self.max_model_len


def split_errors(errors: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the errors a rerun may mend, those of a later turn's prompt that outgrew the
    server's context): vLLM refuses the latter however often they are asked."""
    overflowed = [error for error in errors if OVERFLOW in error["metadata"].get("error", "")]
    return [error for error in errors if error not in overflowed], overflowed


@contextlib.contextmanager
def target_endpoint(
    external: str | None, api_key_env: str | None, start_server: Callable[[], AbstractContextManager[str]]
) -> Iterator[str]:
    """Base URL to generate with: a server started for the block, or the external
    endpoint (through a loopback proxy that adds the API key, when one is named)."""
    if not external:
        with start_server() as url:
            yield url
    elif api_key_env:
        with authenticating_proxy(external, api_key_from_env(api_key_env)) as url:
            yield url
    else:
        yield external
