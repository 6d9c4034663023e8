"""The wheel as a user installs it: every module of the package, and the `draftflow` command.

The wheel is built from a copy of the checkout and installed into a fresh venv;
the tests run it from outside the checkout, which is on no path there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from draftflow.cli import COMMANDS

REPO = Path(__file__).resolve().parents[1]
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]

IMPORT_EVERY_MODULE = """
import importlib, json, os, pkgutil, sys
import draftflow
modules = [module.name for module in pkgutil.walk_packages(draftflow.__path__, "draftflow.")]
for name in modules:
    importlib.import_module(name)
holders = [os.path.abspath(entry) for entry in sys.path if os.path.isdir(os.path.join(entry, "draftflow"))]
print(json.dumps({"file": draftflow.__file__, "modules": modules, "draftflow_holders": holders}))
"""

HEAVY_IMPORTS_OF_PROGRESS = """
import sys
from draftflow import cli
try:
    cli.main(["progress", "--help"])
except SystemExit:
    pass
print(sorted({"torch", "transformers", "vllm"} & set(sys.modules)))
"""


def run(command: list, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    """``command`` in ``cwd`` with PYTHONPATH unset; output captured."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    process = subprocess.run([str(part) for part in command], cwd=cwd, env=env, capture_output=True, text=True)
    if check and process.returncode != 0:
        pytest.fail(f"{command} failed ({process.returncode}):\n{process.stdout[-3000:]}\n{process.stderr[-3000:]}")
    return process


def module_names(package: Path) -> set[str]:
    """The dotted names of the modules and subpackages under the source folder ``package``."""
    names = set()
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names - {package.name}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, set[str]]:
    """A fresh venv holding the wheel built from a copy of the checkout, the test
    venv's packages visible in it; and the modules of the copy's source."""
    root = tmp_path_factory.mktemp("packaging")
    source = root / "src"
    source.mkdir()
    shutil.copy(REPO / "pyproject.toml", source)
    shutil.copytree(REPO / "draftflow", source / "draftflow", ignore=shutil.ignore_patterns("__pycache__"))
    run([*PIP, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", root / "dist", source], root)
    (wheel,) = (root / "dist").glob("draftflow-*.whl")

    venv = root / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], root)
    python = venv / "bin" / "python"
    run([*PIP, "--python", python, "install", "--no-deps", "--no-index", wheel], root)
    # Plain lines of a .pth file go on sys.path as they are: the test venv's own .pth
    # files, the checkout's draftflow.pth among them, are not read.
    site_packages = run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], root).stdout.strip()
    dependencies = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    Path(site_packages, "test-venv-packages.pth").write_text("".join(f"{folder}\n" for folder in dependencies))
    return venv, module_names(source / "draftflow")


def test_every_module_of_the_installed_package_imports_from_the_fresh_venv(installed):
    venv, source_modules = installed
    process = run([venv / "bin" / "python", "-c", IMPORT_EVERY_MODULE], venv.parent)
    imported = json.loads(process.stdout.splitlines()[-1])
    assert Path(imported["file"]).is_relative_to(venv), imported["file"]
    assert set(imported["modules"]) == source_modules
    # no checkout on the path: the venv's site-packages is the only folder with a draftflow
    assert imported["draftflow_holders"] == [str(Path(imported["file"]).parents[1])]


def test_draftflow_help_lists_every_command(installed):
    venv, _ = installed
    process = run([venv / "bin" / "draftflow", "--help"], venv.parent)
    for name, (_, summary) in COMMANDS.items():
        assert f"{name}  " in process.stdout and summary in process.stdout


@pytest.mark.parametrize(
    "command, usage",
    [
        ("plan", "usage: draftflow plan [-h] --configfile FILE [FILE ...]"),
        ("gpus", "usage: draftflow gpus [-h] {run,list,count}"),
        ("progress", "usage: draftflow progress [-h]"),
    ],
)
def test_each_command_hands_its_arguments_to_its_tool(installed, command, usage):
    venv, _ = installed
    process = run([venv / "bin" / "draftflow", command, "--help"], venv.parent)
    assert process.stdout.startswith("usage: ") and usage in process.stdout


def test_an_unknown_command_exits_2(installed):
    venv, _ = installed
    process = run([venv / "bin" / "draftflow", "nonsense"], venv.parent, check=False)
    assert process.returncode == 2
    assert "invalid choice: 'nonsense'" in process.stderr


def test_the_progress_command_imports_neither_torch_nor_vllm(installed):
    venv, _ = installed
    process = run([venv / "bin" / "python", "-c", HEAVY_IMPORTS_OF_PROGRESS], venv.parent)
    assert process.stdout.splitlines()[-1] == "[]"


TINY_TARGET = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 2,
               "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 256, "torch_dtype": "float32"}  # fmt: skip


def test_the_installed_plan_validates_a_config_and_plans_its_run(installed):
    """The schema travels in the wheel: the plan checks the config and fills in its defaults."""
    venv, _ = installed
    folder = venv.parent / "a-run"
    (folder / "target").mkdir(parents=True)
    (folder / "target/config.json").write_text(json.dumps(TINY_TARGET))
    (folder / "prompts.jsonl").write_text('{"messages": [{"role": "user", "content": "What is a list?"}]}\n')
    (folder / "config.yaml").write_text(
        "run: packaged\ndevice: cpu\ntarget: {path: target}\ndata: {prompt_files: [prompts.jsonl]}\n"
        "vocab: {draft_vocab_size: 64}\nextract: {shards: 1}\n"
    )
    plan = run([venv / "bin" / "draftflow", "plan", "--configfile", "config.yaml", "--free-bytes", "1TB", "--json"], folder)
    stages = [stage["name"] for stage in json.loads(plan.stdout)["stages"]]
    assert stages[:3] == ["prompts", "generate_server", "generate"] and "extract_server" in stages
    (folder / "config.yaml").write_text("run: packaged\ndevice: tpu\n")
    refused = run([venv / "bin" / "draftflow", "plan", "--configfile", "config.yaml"], folder, check=False)
    assert refused.returncode == 1 and "config_schema.yaml" in refused.stderr, refused.stderr
