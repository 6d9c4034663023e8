"""The extraction wing: its layout module alone spells the stage's file names; no import circle."""

import ast
import os
import re
import subprocess
import sys

from tests.conftest import REPO

# The stage's file names (draftflow/extract/layout.py) as code would spell them.
LAYOUT_NAME = re.compile(r"(?<![\w])(shard-|server-|hs_)|journal\.jsonl|\.heartbeat\.json")
WING = REPO / "draftflow/extract"


def code_strings(path):
    """String constants of a module, docstrings left out (they may describe the layout)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }  # fmt: skip
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_the_layout_module_is_the_only_place_the_layout_names_live():
    modules = [*REPO.glob("draftflow/**/*.py"), *REPO.glob("scripts/*.py")]
    offenders = [
        f"{path.relative_to(REPO)}: {text!r}"
        for path in modules
        if path != WING / "layout.py"
        for text in code_strings(path)
        if LAYOUT_NAME.search(text)
    ]
    rules = [REPO / "Snakefile", *REPO.glob("rules/*.smk")]
    offenders += [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in rules
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if LAYOUT_NAME.search(line)
    ]
    assert offenders == []
    assert any(LAYOUT_NAME.search(text) for text in code_strings(WING / "layout.py"))  # the pattern finds them


def wing_imports(path):
    """The wing's modules that ``path`` imports."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        imported |= {name.split(".")[2] for name in names if name.startswith("draftflow.extract.")}
    return imported & {p.stem for p in WING.glob("*.py")}


def test_the_extraction_wing_has_no_import_circle():
    graph = {path.stem: wing_imports(path) - {path.stem} for path in WING.glob("*.py")}
    assert graph["layout"] == set()  # everything may read the layout; it reads nothing of the wing

    def reaches(start, goal, seen=()):
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, (*seen, nxt))) for nxt in graph[start])

    assert [module for module in graph if reaches(module, module)] == []


def test_the_layout_the_progress_check_and_the_plan_import_without_torch():
    code = "import sys, draftflow.extract.layout, draftflow.progress, draftflow.plan; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert result.stdout.strip() == "False"


def test_files_are_named_by_sample_id_and_the_journal_keeps_only_records_of_that_layout(tmp_path):
    from draftflow.extract import layout

    for sample_id in ("s0", "conv-17_a.b", "h0123456789abcdef", "42"):
        assert layout.file_sample_id(layout.file_name(sample_id)) == sample_id
    assert layout.file_sample_id(layout.view_file_name(7)) == "7"  # a view's link, by row
    not_files = [layout.temp_file(tmp_path / layout.file_name("s0")).name, "hs_.safetensors", "hs_s0.safetensors.lock",
                 layout.journal_path(tmp_path).name, "s0.safetensors"]  # fmt: skip
    assert [layout.file_sample_id(name) for name in not_files] == [None] * len(not_files)
    assert layout.is_temp_file(not_files[0])

    digest = layout.token_digest([1, 2, 3])
    assert digest == layout.Sample(5, "s0", [1, 2, 3]).token_digest != layout.token_digest([1, 2, 4])
    first = layout.WrittenFile("s0", digest, 3, 100, "a" * 64)
    again = layout.WrittenFile("s0", layout.token_digest([1, 2, 4]), 3, 100, "b" * 64)
    other = layout.WrittenFile("s1", digest, 3, 100, "c" * 64)
    old_shape = {"index": 2, "sample_id": "s2", "tokens": 3, "bytes": 100, "sha256": "d" * 64}
    lines = [{"settings_key": "k"}, first, old_shape, other, again]
    path = layout.journal_path(tmp_path)
    path.write_text("".join(layout.journal_line(line) + "\n" for line in lines) + '{"sample_id": "s3", "tok')
    assert layout.read_journal(path) == ("k", {"s0": again, "s1": other})  # old shape and torn line skipped
    assert layout.read_journal(tmp_path / "missing.jsonl") == (None, {})


def test_make_clean_keeps_the_answer_stores_and_hidden_states_and_says_so_unless_told_all(tmp_path):
    files = ["results/a/synthetic/generated.jsonl", "results/a/synthetic/work/answers-0123.job-0.jsonl",
             "results/a/hidden_states/shard-0/hs_q1.safetensors", "results/a/train/stats.json",
             "results/b/prompts/conversations.jsonl", "logs/a/generate.log", "benchmarks/a/generate.tsv",
             ".snakemake/metadata/x"]  # fmt: skip
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    make = ["make", "-s", "-f", str(REPO / "Makefile"), "clean", f"PYTHON={sys.executable}"]
    said = subprocess.run(make, cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout
    left = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*") if path.is_file())
    assert left == [files[2], files[1]]
    assert said.splitlines() == [f"kept {tmp_path / 'results/a/hidden_states'} (make clean ALL=1 deletes it)",
                                 f"kept {tmp_path / 'results/a/synthetic/work'} (make clean ALL=1 deletes it)"]  # fmt: skip
    subprocess.run([*make, "ALL=1"], cwd=tmp_path, env=env, capture_output=True, check=True)
    assert list(tmp_path.iterdir()) == []
