"""Every command the docs show is run by a test (issue 50).

The shell blocks (```bash, ```sh, ```shell, ```console) of README.md and docs/*.md are read
at collection; each command in them is one test, named by its file and line:

- ``draftflow ...`` runs for real (``plan``, ``progress``, ``--help``; ``publish`` only with
  ``--dry-run``), ``progress`` against the demo's finished run;
- ``snakemake ...`` dry-runs: ``-n`` added, in a working directory of its own
  (``--directory``), so that nothing lands in the checkout;
- ``make ...`` runs as ``make -n``: the real ``make demo`` is the ``demo_run`` fixture's run
  (the same ``snakemake --cores``, checked in the printed recipe) and the real ``make test``
  is the suite itself, so neither runs here;

each also with a ``.venv/bin/`` or ``.venv-cuda/bin/`` prefix (the checkout's venv runs
them), from the repository root, as the docs say. A config a command names whose target is
a GPU model (the examples') is replaced by a copy with a stand-in target (its
``config.json`` and weight index, STAND_IN_TARGETS) and stand-in prompts, as
tests/test_example_configs.py does. Placeholders (``results/<run>``, ``my.yaml``, ...) are
replaced by PLACEHOLDERS; a ``<...>`` the table does not know fails the test, and so does a
command of any other kind unless NOT_RUN names it with the reason.

The served-drafter section's command (docs/serving.md's ``vllm serve`` line) is the demo's
model card's, which serve_check ran
(``test_the_served_drafter_command_is_the_model_cards_which_served_with_accepted_drafts``);
README's runs as tests/test_walkthrough.py runs the README's commands.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.conftest import DRAFTFLOW, REPO, SNAKEMAKE

DOCS = ("README.md", "docs/*.md")
SHELL_BLOCKS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")

# Placeholder -> what the test puts there. Keys with <...> are replaced wherever they
# stand; the others only as whole words. "{demo_run}" is the demo's finished run folder.
PLACEHOLDERS = {
    "results/<run>": "{demo_run}",  # the demo's run: progress reads it, publish --dry-run lists its drafter
    "results/<earlier run>": "{demo_run}",  # plan --rates: rates measured by the demo
    "<target>": "resources/demo-target",  # the demo's target (README's vllm line, not run: NOT_RUN)
    "my.yaml": "config/examples/llama-8b-1gpu.yaml",  # README: `cp config/examples/llama-8b-1gpu.yaml my.yaml`
    "base.yaml": "config/config.yaml",  # several --configfile merged: the demo's config below my.yaml
    "...": "--configfile config/examples/moe-1t-8gpu.yaml",  # docs/clusters.md's `snakemake --profile profiles/slurm ...`
    "org/name": "draftflow-docs-test/demo-drafter",  # a hub repo id (publish --dry-run never uploads)
}
UNKNOWN_PLACEHOLDER = re.compile(r"<[^<>]*[A-Za-z][^<>]*>")

# The examples' targets (GPU models, absent here) -> a stand-in's config.json (the real
# model's shape) and weight bytes; the examples' prompts are replaced too.
STAND_IN_WEIGHT_NAMES = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
STAND_IN_TARGETS = {
    "/models/Llama-3.1-8B-Instruct": (
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
         "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
         "vocab_size": 128256, "torch_dtype": "bfloat16"},
        16_060_522_496,
    ),  # fmt: skip
    "/models/Kimi-K2-Thinking": (
        {"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840,
         "intermediate_size": 18432, "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 192},
        594_000_000_000,
    ),  # fmt: skip
}

TOOLS = {"draftflow": DRAFTFLOW, "snakemake": SNAKEMAKE, "make": "make"}
VENV_BINS = (".venv/bin/", ".venv-cuda/bin/")  # the checkout's venvs (make install [DEVICE=cuda])
# Commands of other kinds the docs show -> why no test here runs them.
NOT_RUN = {
    "cp": "copies an example to my.yaml: the tests take the example itself for my.yaml (PLACEHOLDERS)",
    "sudo .ci/slurm.sh": "starts or stops a SLURM cluster as root: tests/test_slurm.py runs .ci/slurm.sh",
    "vllm serve": "starts a vLLM server: README's runs in tests/test_walkthrough.py (its CPU variant); docs/serving.md's "
    "is the model card's, which serve_check ran (test_the_served_drafter_command_is_the_model_cards_which_served_with_accepted_drafts)",
}
# Exit codes other than 0 that a tool documents as an answer, with the words that must come
# with them. `draftflow plan` and `progress` exit 3 when the run will not fit the free disk:
# the examples' runs (an 8B and a 1T target) need more than a test machine's disk may hold.
ANSWERS = {"draftflow plan": {3: "will not fit"}, "draftflow progress": {3: "will not fit"}}
# What `make -n TARGET` must print: the docs say what these targets run.
MAKE_RECIPES = {"demo": "bin/snakemake --cores", "test": "bin/pytest -n"}
TIMEOUT_S = 300


@dataclass(frozen=True)
class DocCommand:
    doc: str  # relative to the checkout
    line: int
    text: str  # the doc's line, its comment left out
    part: int = 0  # which command of a line chained with && or ;

    def __str__(self):
        return f"{self.doc}:{self.line}{f'&{self.part + 1}' if self.part else ''}"


def strip_comment(text: str) -> str:
    """The shell line before its ``#`` comment (a ``#`` inside quotes or a word stays)."""
    quote = None
    for i, char in enumerate(text):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].rstrip()
    return text.rstrip()


def shell_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, command) of each command in the file's shell blocks: comments left
    out, continued lines joined, a console block's ``$ `` lines only."""
    found, fence, language, pending = [], None, None, None
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        if match := FENCE.match(raw):
            if fence is None:
                fence, language = match.group(1), match.group(2).lower()
            elif match.group(1).startswith(fence) and not match.group(2):
                fence = language = None
            continue
        if language not in SHELL_BLOCKS:
            continue
        line = raw.strip()
        if language == "console":
            if pending is None and not line.startswith("$ "):
                continue  # output
            line = line.removeprefix("$ ")
        if pending is not None:
            line = f"{pending[1]} {line}"
            number = pending[0]
        line = strip_comment(line)
        if line.endswith("\\"):
            pending = (number, line[:-1].rstrip())
            continue
        pending = None
        if line:
            found.append((number, line))
    return found


def doc_commands() -> list[DocCommand]:
    commands = []
    for pattern in DOCS:
        for path in sorted(glob.glob(str(REPO / pattern))):
            doc = str(Path(path).relative_to(REPO))
            for number, line in shell_lines(Path(path)):
                parts = re.split(r"\s+(?:&&|\|\||;)\s+", line)
                commands += [DocCommand(doc, number, part, i) for i, part in enumerate(parts)]
    return commands


COMMANDS = doc_commands()


def without_variables(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """The ``VAR=value`` words before a command, and the command."""
    variables = {}
    while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
        name, value = words[0].split("=", 1)
        variables[name], words = value, words[1:]
    return variables, words


def substituted(text: str, demo_run: Path) -> str:
    """The command with PLACEHOLDERS' values; fails on a ``<...>`` the table lacks."""
    for key in sorted(PLACEHOLDERS, key=len, reverse=True):
        pattern = re.escape(key) if "<" in key else rf"(?<![\w./-]){re.escape(key)}(?![\w./-])"
        value = PLACEHOLDERS[key].format(demo_run=demo_run)
        text = re.sub(pattern, lambda _: value, text)
    if unknown := UNKNOWN_PLACEHOLDER.findall(text):
        pytest.fail(f"placeholder(s) {unknown} that PLACEHOLDERS in {__file__} does not know: add each, with what it stands for")
    return text


def without_venv(word: str) -> str:
    return next((word[len(folder) :] for folder in VENV_BINS if word.startswith(folder)), word)


def command_kind(words: list[str]) -> tuple[str, list[str]] | None:
    """(tool, its arguments) for draftflow, snakemake and make, with or without a venv's bin/."""
    name = without_venv(words[0])
    return (name, words[1:]) if name in TOOLS else None


def check_repository_paths(words: list[str]) -> None:
    """Relative paths into the checkout's folders (config/..., profiles/..., .ci/...) exist."""
    for word in words:
        first = word.split("/", 1)[0]
        if "/" in word and not word.startswith("/") and (REPO / first).is_dir():
            assert (REPO / word).exists(), f"{word} does not exist in the checkout"


def stand_in_config(path: str, folder: Path) -> str:
    """``path`` itself, or, where its config names a target of STAND_IN_TARGETS, a copy with
    that stand-in target and stand-in prompts."""
    if not (REPO / path).is_file():
        return path  # the tool says what is missing
    config = yaml.safe_load((REPO / path).read_text()) or {}
    target = (config.get("target") or {}).get("path")
    if target not in STAND_IN_TARGETS:
        return path
    model_config, weight_bytes = STAND_IN_TARGETS[target]
    stand_in = folder / "targets" / Path(target).name
    if not stand_in.exists():
        stand_in.mkdir(parents=True)
        (stand_in / "config.json").write_text(json.dumps(model_config))
        index = {"metadata": {"total_size": weight_bytes}, "weight_map": dict.fromkeys(STAND_IN_WEIGHT_NAMES, "model-00001-of-00004.safetensors")}
        (stand_in / "model.safetensors.index.json").write_text(json.dumps(index))
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": f"Question {i}?"}]}) + "\n" for i in range(8)))
    config["target"]["path"] = str(stand_in)
    config.setdefault("data", {})["prompt_files"] = [str(prompts)]
    copy = folder / "configs" / Path(path).name
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(yaml.safe_dump(config))
    return str(copy)


def with_stand_ins(arguments: list[str], folder: Path) -> list[str]:
    """The arguments with each config file after ``--configfile`` through ``stand_in_config``."""
    result, in_configfiles = [], False
    for word in arguments:
        if word.startswith("-"):
            in_configfiles = word in ("--configfile", "--configfiles")
            if word.startswith(("--configfile=", "--configfiles=")):
                option, value = word.split("=", 1)
                word = f"{option}={stand_in_config(value, folder)}"
        elif in_configfiles:
            word = stand_in_config(word, folder)
        result.append(word)
    return result


def not_run_reason(words: list[str]) -> str | None:
    """NOT_RUN's reason for the command (its first word with or without a venv's bin/)."""
    line = " ".join([without_venv(words[0]), *words[1:]])
    return next((reason for prefix, reason in NOT_RUN.items() if line == prefix or line.startswith(prefix + " ")), None)


def run_doc_command(command: DocCommand, demo_run: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run (or dry-run) one doc command of TOOLS as the module docstring says. Fails on a
    placeholder the table lacks, a missing checkout path, or an exit other than 0 (or a
    tool's ANSWERS with their words)."""
    variables, words = without_variables(shlex.split(substituted(command.text, demo_run)))
    env = dict(os.environ, PATH=f"{DRAFTFLOW.parent}{os.pathsep}{os.environ['PATH']}", **variables)  # the venv, activated
    check_repository_paths(words)
    tool, arguments = command_kind(words)
    arguments = with_stand_ins(arguments, tmp_path)
    if tool == "draftflow":
        if arguments[:1] == ["publish"] and "--dry-run" not in arguments:
            pytest.fail(f"{command}: `draftflow publish` without --dry-run uploads: no test runs it; show --dry-run")
        name = f"draftflow {arguments[0]}" if arguments and not arguments[0].startswith("-") else "draftflow"
    elif tool == "snakemake":
        if not {"-n", "--dry-run", "--dryrun"} & set(arguments):
            arguments.append("-n")
        if not {"-d", "--directory"} & set(arguments):
            (tmp_path / "workdir").mkdir(exist_ok=True)
            arguments += ["--directory", str(tmp_path / "workdir")]
        name = "snakemake"
    else:
        arguments = ["-n", *arguments]
        name = "make"
    process = subprocess.run([str(TOOLS[tool]), *arguments], cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    output = process.stdout + process.stderr
    answer = ANSWERS.get(name, {}).get(process.returncode)
    assert process.returncode == 0 or (answer and answer in output.lower()), (
        f"{command}: `{command.text}` exited {process.returncode} "
        f"(run as {shlex.join([str(TOOLS[tool]), *arguments])}):\n{output[-4000:]}"
    )
    if "--json" in arguments and process.returncode == 0:
        json.loads(process.stdout)
    if tool == "snakemake":
        assert "This was a dry-run" in output, output[-2000:]
    if tool == "make":
        for target in (word for word in arguments[1:] if word in MAKE_RECIPES):
            assert MAKE_RECIPES[target] in process.stdout, f"`make -n {target}` does not run {MAKE_RECIPES[target]}:\n{process.stdout}"
    return process


def run_here(command: DocCommand) -> bool:
    """Whether the command is one of TOOLS', which a test here runs."""
    return command_kind(without_variables(shlex.split(command.text))[1]) is not None


@pytest.mark.parametrize("command", [command for command in COMMANDS if run_here(command)], ids=str)
def test_every_command_a_doc_shows_runs(command, demo_run, tmp_path):
    run_doc_command(command, demo_run, tmp_path)


def test_every_other_command_a_doc_shows_is_named_with_the_reason_no_test_here_runs_it():
    others = [command for command in COMMANDS if not run_here(command)]
    unnamed = [f"{command}: `{command.text}`" for command in others if not_run_reason(without_variables(shlex.split(command.text))[1]) is None]
    assert others and unnamed == [], (f"not draftflow, snakemake or make commands: run them here, or name each in NOT_RUN "
                                      f"with the reason no test runs it: {unnamed}")  # fmt: skip


def test_the_docs_commands_are_found(tmp_path):
    """The extraction sees the commands the docs hold: each doc with a shell block gives
    commands (a fence the parser misread would hide them), README.md's walkthrough its five."""
    with_blocks = {
        str(Path(path).relative_to(REPO))
        for pattern in DOCS
        for path in glob.glob(str(REPO / pattern))
        if any((m := FENCE.match(line)) and m.group(2).lower() in SHELL_BLOCKS for line in Path(path).read_text().splitlines())
    }
    assert with_blocks and with_blocks == {command.doc for command in COMMANDS}
    readme = {c.line: c.text for c in COMMANDS if c.doc == "README.md"}
    first = next(line for line, text in readme.items() if text.startswith("cp config/examples/"))
    walkthrough = list(itertools.takewhile(bool, (readme.get(line) for line in itertools.count(first))))
    assert len(walkthrough) == 5, walkthrough  # "Your model in five commands": one block, from the copied config on
    markdown = tmp_path / "doc.md"
    markdown.write_text("```bash\nmake demo  # the demo\necho '# kept'\n```\n"
                        "```console\n$ draftflow plan \\\n  --json\noutput\n```\n```yaml\nrun: x\n```\n"
                        "   ```sh\n   make -n\n   ```\n")  # fmt: skip
    assert shell_lines(markdown) == [(2, "make demo"), (3, "echo '# kept'"), (6, "draftflow plan --json"), (14, "make -n")]


def serving_commands() -> list[DocCommand]:
    return [command for command in COMMANDS if command.doc == "docs/serving.md" and command.text.startswith("vllm serve ")]


def test_the_served_drafter_command_is_the_model_cards_which_served_with_accepted_drafts(demo_run):
    """The served-drafter section's command, as docs/serving.md writes it, is the demo's model
    card's, which serve_check's server ran (its flags and drafter:
    test_train_evaluate_report.py's model card test holds the card to serve_check's server log),
    and there vLLM drafted and accepted drafts (served.json, from its /metrics). No server is
    started again to repeat that."""
    commands = serving_commands()
    assert commands, "docs/serving.md shows no `vllm serve` command in a shell block"
    card = (demo_run / "drafter/README.md").read_text()
    for command in commands:
        assert command.text in card, f"{command}: not the command the demo's model card gives ({demo_run}/drafter/README.md)"
        words = shlex.split(substituted(command.text, demo_run))
        assert words[:2] == ["vllm", "serve"] and "--speculative-config" in words, f"{command}: serves no drafter"
    served = json.loads((demo_run / "evaluation/served.json").read_text())
    assert served["drafts"] > 0 and served["accepted_tokens"] > 0, served
