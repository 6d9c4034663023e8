"""The owner of what each stage's work depends on (draftflow.dependencies): identities,
keys, every schema key accounted for, the stage graph as Snakemake builds it, and the
rebuild table (docs/rebuilds.md) as the module renders it."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from safetensors.torch import save_file

from draftflow import dependencies, rebuild_table
from draftflow.answers import answer_store, conversation_key, server_of, share
from draftflow.config import load_config
from draftflow.answers import generation_key
from draftflow.dependencies import NO_EFFECT, STAGES
from draftflow.server_flags import keyed_server_flags
from draftflow.rebuild_table import REBUILDS
from draftflow.fingerprint import model_identity, target_fingerprint, tokenizer_identity
from tests.conftest import REPO, demo_config, snakemake, workflow_copy


def small_target(folder: Path, seed: int = 0) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    save_file({"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(seed))}, str(folder / "model.safetensors"))
    return folder


def test_the_model_identity_follows_config_and_weights_of_the_same_shape_not_paths_mtimes_or_the_tokenizer(tmp_path):
    target = small_target(tmp_path / "target")
    model, tokenizer = model_identity(target), tokenizer_identity(target)
    moved = tmp_path / "moved"
    shutil.copytree(target, moved)  # other mtimes and another path: the same target
    os.utime(moved / "model.safetensors", (1, 1))
    assert (model_identity(moved), tokenizer_identity(moved)) == (model, tokenizer)
    (moved / "chat_template.jinja").write_text("{{ messages[-1].content }}")
    assert model_identity(moved) == model and tokenizer_identity(moved) != tokenizer
    # a fine-tune saved over the old weights: the same names, shapes and header
    shutil.copy(small_target(tmp_path / "other", seed=1) / "model.safetensors", target / "model.safetensors")
    assert model_identity(target) != model and tokenizer_identity(target) == tokenizer
    before = target_fingerprint(target)
    (target / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    assert target_fingerprint(target) != before and model_identity(target) != model


SERVER = ["--dtype", "float32", "--max-model-len", "512", "--tensor-parallel-size", "1", "--data-parallel-size", "1",
          "--seed", "0", "--enforce-eager"]  # fmt: skip
ASKED = {"max_tokens": 64, "temperature": 0.0, "seed": 0, "concurrency": 8}  # generation's settings, as the rule's


def test_the_answer_store_key_follows_target_template_and_output_changing_flags_not_paths(tmp_path):
    target = small_target(tmp_path / "target")
    key = generation_key(target, SERVER, ASKED)
    moved = tmp_path / "elsewhere/target"
    shutil.copytree(target, moved)
    assert generation_key(moved, SERVER, ASKED) == key  # a copied or moved target finds its answers
    # flags that change no answer: more replicas, more room, eager kernels
    unkeyed = [*SERVER[:2], "--max-model-len", "4096", *SERVER[4:6], "--data-parallel-size", "4", "--seed", "0"]
    assert generation_key(target, unkeyed, ASKED) == key
    for changed in (["--dtype", "bfloat16", *SERVER[2:]], [*SERVER, "--quantization", "fp8"]):
        assert generation_key(target, changed, ASKED) != key
    for changed in ({"max_tokens": 65}, {"temperature": 0.5}, {"seed": 1}, {"sampling": {"top_p": 0.95}},
                    {"chat_template_kwargs": {"enable_thinking": False}}, {"system_prompt": "Be brief."}):
        assert generation_key(target, SERVER, ASKED | changed) != key, changed
    # unset, the settings added since keep the key runs before them stored their answers under
    unset = ASKED | {"sampling": {"top_p": None}, "chat_template_kwargs": {}, "system_prompt": None}
    before_them = [target_fingerprint(target), keyed_server_flags(SERVER), 64, 0.0, 0]
    assert generation_key(target, SERVER, unset) == hashlib.sha256(json.dumps(before_them).encode()).hexdigest()[:16] == key
    # --chat-template counts by the text it gives: a file and the same text inline agree
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages[0].content }}")
    from_file = generation_key(target, [*SERVER, "--chat-template", str(template)], ASKED)
    assert from_file != key
    assert generation_key(target, [*SERVER, f"--chat-template={template.read_text()}"], ASKED) == from_file
    assert keyed_server_flags([*SERVER, "--chat-template", str(template)])[-1].startswith("--chat-template=sha256:")
    (target / "chat_template.jinja").write_text("{{ messages }}")
    assert generation_key(target, SERVER, ASKED) != key
    assert answer_store(tmp_path, key, 0).name == f"answers-{key}.job-0.jsonl"
    question = {"id": "q1", "messages": [{"role": "user", "content": "hi"}]}
    assert conversation_key({**question, "id": "renamed"}) == conversation_key(question)
    assert conversation_key({**question, "messages": [{"role": "user", "content": "hi!"}]}) != conversation_key(question)


def extraction_key(workflow: Path, backend: str, env: dict | None = None) -> str:
    """The journal key of a target's extraction, computed by the draftflow in ``workflow``."""
    code = (
        "import sys; from pathlib import Path; from draftflow.extract.journal_key import extraction_settings; "
        f"print(extraction_settings({backend!r}, [1, 2], 'float32', 'full', Path(sys.argv[1]), {SERVER!r}).key())"
    )
    environment = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(filter(None, [(env or {}).get("PYTHONPATH"), str(workflow)]))}
    target = workflow.parent / "target"
    return subprocess.run([sys.executable, "-c", code, str(target)], env=environment, capture_output=True, text=True,
                          check=True, cwd=workflow).stdout.strip()  # fmt: skip


def test_the_extraction_key_follows_the_code_and_the_package_builds(tmp_path):
    """An edit of the connector changes the vllm backend's key, not the transformers
    backend's; another installed torch (a distribution found first on the path) changes both."""
    small_target(tmp_path / "target")
    (tmp_path / "workflow").mkdir()
    workflow = workflow_copy(tmp_path / "workflow")
    before = {backend: extraction_key(workflow, backend) for backend in ("vllm", "transformers")}
    connector = workflow / "draftflow/extract/vllm_connector.py"
    connector.write_text(connector.read_text() + "\n# an edit\n")
    assert extraction_key(workflow, "vllm") != before["vllm"]
    assert extraction_key(workflow, "transformers") == before["transformers"]
    connector.write_text(connector.read_text().removesuffix("\n# an edit\n"))
    assert extraction_key(workflow, "vllm") == before["vllm"]
    upgraded = tmp_path / "upgraded/torch-99.0.dist-info"
    upgraded.mkdir(parents=True)
    (upgraded / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 99.0\n")
    for backend in ("vllm", "transformers"):
        assert extraction_key(workflow, backend, {"PYTHONPATH": str(upgraded.parent)}) != before[backend]


def schema_keys() -> set[str]:
    def walk(prefix, node):
        properties = node.get("properties")
        if not properties:
            return {prefix}
        return {key for name, child in properties.items() for key in walk(f"{prefix}.{name}".lstrip("."), child)}

    return walk("", yaml.safe_load((REPO / "draftflow/config_schema.yaml").read_text()))


def test_every_schema_key_is_read_by_a_stage_or_has_no_effect_for_a_reason():
    keys = schema_keys()
    config = load_config(REPO / "config/config.yaml")  # every key, defaults filled in
    read = {leaf for stage in STAGES for leaf in dependencies.stage_config(config, stage)}
    assert not set(NO_EFFECT) - keys, "NO_EFFECT names keys the schema lacks"
    assert all(len(why.split()) >= 3 for why in NO_EFFECT.values())
    unaccounted = {key for key in keys - read - set(NO_EFFECT) if not any(key.startswith(f"{k}.") for k in read)}
    assert not unaccounted, f"schema keys in no stage's list and not named in NO_EFFECT: {sorted(unaccounted)}"


def test_the_stage_graph_is_the_one_snakemake_builds(tmp_path):
    graph = snakemake(tmp_path, demo_config(pilot={"enabled": True}), "--rulegraph").stdout  # every rule in the graph
    names = dict(re.findall(r'^\s*(\d+)\[label = "(\w+)"', graph, flags=re.MULTILINE))
    edges = {(names[a], names[b]) for a, b in re.findall(r"^\s*(\d+) -> (\d+)", graph, flags=re.MULTILINE)}
    built = {(a, b) for a, b in edges if a in STAGES and b in STAGES}
    assert built == {(before, stage) for stage, reads in STAGES.items() for before in reads.after}
    assert {stage for stage, reads in STAGES.items() if reads.target} == {b for a, b in edges if a == "demo_target"} - {"prompts", "provenance"}


def test_every_rule_takes_its_depends_from_the_owner():
    rules = "".join(path.read_text() for path in sorted((REPO / "rules").glob("*.smk")))
    named = re.findall(r"^rule (\w+):", rules, flags=re.MULTILINE)
    assert set(named) - {"demo_target"} == set(STAGES)
    for stage in STAGES:
        body = rules.split(f"rule {stage}:\n", 1)[1].split("\nrule ", 1)[0]
        assert f'depends=depends_on("{stage}"),' in body, stage


def test_the_readme_rebuild_table_is_the_one_the_owner_renders():
    readme = (REPO / "docs/rebuilds.md").read_text()
    assert rebuild_table.render_rebuild_table() in readme and rebuild_table.render_no_effect_table() in readme
    for row in REBUILDS:
        file, test = row.test.split("::")
        name, _, param = test.partition("[")
        source = (REPO / "tests" / file).read_text()
        assert f"def {name}(" in source, row.test
        assert not param or param.rstrip("]") in source, row.test
        assert (row.check == "dry run") == ("planned_" in source.split(f"def {name}(", 1)[1].split("\ndef ", 1)[0]), row.test


def test_a_conversation_goes_to_one_generation_job_and_another_count_moves_only_what_it_must():
    """Rendezvous hashing: from 2 jobs to 3, only the conversations the new job wins move
    (about a third), each job's share is about even, and the order of the rows does not
    count."""
    conversations = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(3000)]
    two, three = ({c["id"]: server_of(conversation_key(c), n) for c in conversations} for n in (2, 3))
    moved = {c for c in two if two[c] != three[c]}
    assert all(three[c] == 2 for c in moved) and 0.28 < len(moved) / len(conversations) < 0.39
    for servers in (2, 3):
        shares = [share(conversations, s, servers) for s in range(servers)]
        assert sorted(c["id"] for part in shares for c in part) == sorted(two)  # each in exactly one share
        assert all(abs(len(part) - len(conversations) / servers) < 0.06 * len(conversations) for part in shares)
    assert share(conversations[::-1], 1, 2) == share(conversations, 1, 2)[::-1]
    assert {server_of(conversation_key(c), 1) for c in conversations} == {0}
