"""The real example configs dry-run, with bounded job counts."""

import json
import re
import shutil
import subprocess

import pytest
import yaml

from draftflow.io import write_jsonl
from tests.conftest import REPO, SNAKEMAKE, snakemake
from tests.twins import build_twin


def job_counts(dry_run_output: str) -> dict[str, int]:
    table = dry_run_output.split("Job stats:", 1)[1].split("\n\n", 1)[0]
    return {name: int(count) for name, count in re.findall(r"^(\w+)\s+(\d+)$", table, flags=re.MULTILINE)}


def example_config(name, tmp_path, num_layers, weight_bytes=None):
    """The example with its weights and prompt paths pointed at stand-ins."""
    config = yaml.safe_load((REPO / "config/examples" / name).read_text())
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": num_layers, "vocab_size": 128256}))
    if weight_bytes:
        names = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")  # what the parse reads of them
        index = {"metadata": {"total_size": weight_bytes}, "weight_map": dict.fromkeys(names, "model-00001-of-00004.safetensors")}
        (target / "model.safetensors.index.json").write_text(json.dumps(index))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    config["target"]["path"] = str(target)
    config["data"]["prompt_files"] = [str(prompts)]
    return config


@pytest.mark.parametrize(
    ("name", "num_layers", "gpus", "servers"),
    [("llama-8b-1gpu.yaml", 32, "0", 1), ("llama-8b-1gpu.yaml", 32, "0,1", 2), ("moe-1t-8gpu.yaml", 61, "0,1,2,3,4,5,6,7", 1)],
)  # fmt: skip
def test_example_dry_runs_load_the_model_once_per_server_that_fits_the_node(tmp_path, monkeypatch, name, num_layers, gpus, servers):
    """Loads follow the servers the node's GPUs hold, not the shards (the 1T example: 64 shards, one load)."""
    monkeypatch.setenv("DRAFTFLOW_GPUS", gpus)
    config = example_config(name, tmp_path, num_layers)
    process = snakemake(tmp_path, config, "-n")
    counts = job_counts(process.stdout)
    assert counts["extract_server"] == servers and config["extract"]["shards"] > servers
    assert counts["total"] < 22  # about a job per rule, not one per shard (the 1T example has 64)
    shards = config["extract"]["shards"]
    assert f"extract: {shards} shards on {servers} server job(s), one model load each" in process.stderr


@pytest.mark.parametrize(
    ("name", "num_layers", "weight_bytes", "checked"),
    [("llama-8b-1gpu.yaml", 32, 16_060_522_496, True), ("moe-1t-8gpu.yaml", 61, 594_000_000_000, False)],
)
def test_example_dry_runs_say_whether_fidelity_is_checked(tmp_path, name, num_layers, weight_bytes, checked):
    config = example_config(name, tmp_path, num_layers, weight_bytes)
    output = snakemake(tmp_path, config, "-n").stderr
    message = next(line for line in output.splitlines() if line.startswith("fidelity: ")).split("fidelity: ", 1)[1]
    assert message.startswith("checked:" if checked else "not checked:"), message
    assert f"{weight_bytes / 1e9:.2f} GB of weights" in message and "80.00 GB" in message


def test_layer_ids_beyond_the_target_stop_the_run_at_parse_time(tmp_path):
    config = example_config("llama-8b-1gpu.yaml", tmp_path, 32)
    config["extract"] = {**config.get("extract", {}), "layer_ids": [2, 16, 40]}
    process = snakemake(tmp_path, config, "-n", check=False)
    assert process.returncode != 0
    output = process.stdout + process.stderr
    assert "extract.layer_ids [2, 16, 40]" in output and "0..31" in output


def test_a_users_config_file_stands_alone_also_run_in_the_checkout(tmp_path):
    """Run where config/config.yaml lies (the checkout), a --configfile without
    data.num_samples samples the schema's default (1000: all 250 rows), not the demo's 240."""
    shutil.copytree(REPO / "config", tmp_path / "config")
    prompts = tmp_path / "prompts.jsonl"
    write_jsonl(prompts, [{"id": f"q{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(250)])
    # the twin's 4 layers and 1507 tokens need their own layer ids and draft vocabulary
    config = {"run": "alone", "device": "cpu", "target": {"path": str(build_twin("qwen3_moe", tmp_path / "target")), "dtype": "float32"},
              "data": {"prompt_files": [str(prompts)]}, "vocab": {"draft_vocab_size": 64},
              "extract": {"layer_ids": [1, 2, 3]}}  # fmt: skip
    assert yaml.safe_load((REPO / "config/config.yaml").read_text())["data"]["num_samples"] == 240
    snakemake(tmp_path, config, "results/alone/prompts/conversations.jsonl")
    assert len((tmp_path / "results/alone/prompts/conversations.jsonl").read_text().splitlines()) == 250


def undescribed(node: dict, prefix: str = "") -> list[str]:
    """The keys under ``node``'s properties (recursively) that have no description."""
    found = []
    for name, child in node.get("properties", {}).items():
        key = f"{prefix}.{name}".lstrip(".")
        found += ([] if "description" in child else [key]) + undescribed(child, key)
    return found


def test_every_config_key_says_what_it_does():
    schema = yaml.safe_load((REPO / "draftflow/config_schema.yaml").read_text())
    source = next(option for option in schema["$defs"]["prompt_source"]["oneOf"] if option.get("type") == "object")
    assert undescribed(schema) + undescribed(source, "a prompt source") == []
    assert undescribed({"properties": {"a": {"properties": {"b": {}}, "description": "x"}}}) == ["a.b"]


def test_several_config_files_merge_as_snakemake_merges_them(tmp_path):
    """`draftflow plan --configfile A B` and `draftflow progress --configfile A B` read the
    config the workflow runs with: B's keys over A's, section by section."""
    import copy

    from snakemake.utils import update_config

    from draftflow.config import load_config, schema, with_defaults

    base = {"run": "x", "target": {"path": "t", "dtype": "float32"}, "data": {"prompt_files": ["p.jsonl"]},
            "generate": {"max_tokens": 64, "sampling": {"top_p": 0.9}}}  # fmt: skip
    over = {"target": {"dtype": "bfloat16"}, "data": {"prompt_files": ["q.jsonl"]}, "generate": {"sampling": {"top_k": 20}}}
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(base))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(over))
    expected = copy.deepcopy(base)
    update_config(expected, over)
    config = load_config(tmp_path / "a.yaml", tmp_path / "b.yaml")
    assert config == with_defaults(expected, schema())
    assert config["generate"]["sampling"]["top_p"] == 0.9 and config["data"]["prompt_files"] == ["q.jsonl"]
    (tmp_path / "c.yaml").write_text("vllm: {max_model_len: 8}\n")
    with pytest.raises(ValueError, match=r"a.yaml, .*c.yaml: vllm.max_model_len: 8 is less than the minimum of 16"):
        load_config(tmp_path / "a.yaml", tmp_path / "c.yaml")


def test_the_configuration_reference_is_the_table_the_schema_renders():
    from draftflow.config import parameter_table

    reference = (REPO / "docs/configuration.md").read_text()
    begin, end = "<!-- parameter table (python -m draftflow.config) -->\n", "<!-- parameter table: end -->"
    assert reference.split(begin, 1)[1].split(end, 1)[0] == parameter_table(), "run: python -m draftflow.config"
    assert "| `generate.sampling.top_p` | number or null | `null` | Sample from the smallest set" in reference


@pytest.mark.parametrize("layers", [["demo-gpu.yaml"], ["demo-gpu.yaml", "demo-gpu-cpu-prep.yaml"]])
def test_the_gpu_recipes_configs_merged_over_the_demos_dry_run(tmp_path, layers):
    """BENCHMARKS.md's GPU recipe: `--configfile config/config.yaml bench/gpu/demo-gpu.yaml [...]`."""

    files = [str(REPO / "config/config.yaml"), *(str(REPO / "bench/gpu" / name) for name in layers)]
    command = [str(SNAKEMAKE), "--snakefile", str(REPO / "Snakefile"), "-n", "--cores", "2", "--configfile", *files]
    process = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True)
    assert process.returncode == 0, process.stderr[-2000:]
    assert "results/gpu/" in process.stdout and "extract_server" in process.stdout
