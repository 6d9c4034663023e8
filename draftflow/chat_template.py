"""Which chat template generation renders its prompts with: what generate records and
prepare checks its tokenizer against.

vLLM renders with the template its ``--chat-template`` flag gives (a file, or the
template itself), else with the tokenizer's own (transformers reads it from
``chat_template.jinja``, else from ``tokenizer_config.json``). An endpoint the
workflow did not start renders with whatever it was given: not known here.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

FLAG = "--chat-template"
UNKNOWN = "the endpoint's own (generate.endpoint): not known to draftflow"


def flag_value(server_args: list[str], flag: str = FLAG) -> str | None:
    """The value of ``flag`` (``--chat-template`` unless named) among a server's flags
    (either spelling), if any."""
    for position, arg in enumerate(server_args):
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
        if arg == flag and position + 1 < len(server_args):
            return server_args[position + 1]
    return None


def tokenizer_template_file(target: str) -> Path:
    jinja = Path(target) / "chat_template.jinja"
    return jinja if jinja.exists() else Path(target) / "tokenizer_config.json"


def served_template(tokenizer, target: str, given: str | None) -> tuple[str, str | None]:
    """(where the template vLLM renders with comes from, its text) for a server draftflow
    starts with ``--chat-template given`` (None: not given); the text is None where the
    tokenizer has none."""
    if given is None:
        return f"the tokenizer's own ({tokenizer_template_file(target)})", tokenizer.chat_template
    where = f"the file {given}" if Path(given).is_file() else "the text given inline"
    return f"{where} (vllm.extra_args {FLAG})", flag_text(given)


def flag_text(given: str) -> str:
    """The template a ``--chat-template`` value gives: a file's text, or the value itself."""
    path = Path(given)
    return path.read_text() if path.is_file() else given


def digest(text: str | None) -> str | None:
    return hashlib.sha256(text.encode()).hexdigest() if text is not None else None


def generation_record(tokenizer, target: str, server_args: list[str] | None) -> dict:
    """What generate's stats say of the template: its source and its text's sha256;
    ``server_args``: the flags of the server draftflow started (None: an endpoint's)."""
    if server_args is None:
        return {"source": UNKNOWN, "sha256": None}
    source, text = served_template(tokenizer, target, flag_value(server_args))
    return {"source": source, "sha256": digest(text)}


def check_generation_used(record: dict, source: str, text: str | None, stats_file: Path) -> None:
    """Stop when the template to render with now (``source``, ``text``) is not the one
    generation recorded; an endpoint's template is not known, so it is not checked."""
    if record["sha256"] not in (None, digest(text)):
        raise ValueError(
            f"The chat template generation rendered its prompts with ({record['source']}, sha256 "
            f"{record['sha256'][:12]}, {stats_file}) is not the one to render with now ({source}, "
            f"sha256 {(digest(text) or 'none')[:12]}): the drafter would train on prompts "
            "rendered otherwise than vLLM now renders them. Generate again "
            "(snakemake --forcerun generate), or restore the template generation used."
        )
