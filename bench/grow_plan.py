"""What growing the 1T reference run from 10,000 to 12,000 samples costs, as the plan computes it.

    .venv/bin/python bench/grow_plan.py [--scratch DIR] [--json bench/results/grow_plan.json]

The reference run of issue 14 (tests/test_plan.py: a Kimi-K2-class target at
tensor parallel 8 on one node, the model loaded in 24.5 minutes, extraction at
2.5 samples/s of 1,449 tokens) with 12,000 prompts, planned twice by
draftflow.plan.build_plan with the CUDA default rates for the rest:

- ``after``: the folder holds what the 10,000-sample run left: the answer store
  with its 10,000 answers and shard journals vouching for their 10,000
  hidden-state files (sparse files of their exact sizes), so the plan asks and
  extracts the 2,000 new samples only;
- ``before``: what a rerun cost before answers and files were reused by
  content: generation asked every conversation again (its work file was keyed by
  the whole prompts file) and every hidden-state file had to be extracted again
  (files were named by dataset row, and the rows moved): the plan of the empty
  folder, with the earlier run's answer lengths as its rates.

Prints both, per stage, and the difference. Standard library and PyYAML only.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from draftflow.answers import answer_store, conversation_key  # noqa: E402
from draftflow.config import load_config  # noqa: E402
from draftflow.extract import layout  # noqa: E402
from draftflow.dependencies import run_extraction_settings, run_generation_key  # noqa: E402
from draftflow.extract.layout import Sample  # noqa: E402
from draftflow.io import write_jsonl  # noqa: E402
from draftflow.layers import resolve_layer_ids  # noqa: E402
from draftflow.plan import build_plan, load_rates  # noqa: E402
from draftflow.prompts import config_selection  # noqa: E402
from draftflow.target_model import read_target_model  # noqa: E402

BEFORE, AFTER = 10_000, 12_000
TOKENS_PER_SAMPLE, PROMPT_TOKENS = 1449, 100
REFERENCE_RATES = {"model_load_s": 24.5 * 60, "extract_tokens_per_s": 2.5 * TOKENS_PER_SAMPLE}
TARGET = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840,
          "intermediate_size": 18432, "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 192}  # fmt: skip


def reference_folder(workdir: Path) -> tuple[dict, Path]:
    """The target's stand-in, 12,000 prompts and the config that asks for all of them."""
    target = workdir / "target"
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps(TARGET))
    (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 594_000_000_000}, "weight_map": {}}))
    prompts = workdir / "prompts.jsonl"
    write_jsonl(prompts, [{"id": f"p{i:05d}", "messages": [{"role": "user", "content": f"Question {i}: " + "x" * 390}]}
                          for i in range(AFTER)])  # fmt: skip
    config = yaml.safe_load((REPO / "config/examples/moe-1t-8gpu.yaml").read_text())
    config["target"]["path"] = str(target)
    config["data"] |= {"prompt_files": [str(prompts)], "num_samples": AFTER}
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    (workdir / "rates.yaml").write_text(yaml.safe_dump(REFERENCE_RATES))
    return load_config(workdir / "config.yaml"), target


def leave_the_first_run(workdir: Path, config: dict, target: Path) -> None:
    """The answers and hidden-state files of the 10,000-sample run, as it leaves them."""
    rng = random.Random(0)
    first = config_selection({**config, "data": {**config["data"], "num_samples": BEFORE}}).rows
    run_dir = workdir / "results" / config["run"]
    store = answer_store(run_dir / "synthetic/work", run_generation_key(config, read_target_model(target)), 0)
    samples, rows = [], []
    for conversation in first:
        ids = [rng.randrange(TARGET["vocab_size"]) for _ in range(TOKENS_PER_SAMPLE)]
        key = conversation_key(conversation)
        rows.append({"id": f"{key}_gen0", "primary_id": key, "input_ids": ids,
                     "loss_mask": [0] * PROMPT_TOKENS + [1] * (TOKENS_PER_SAMPLE - PROMPT_TOKENS), "metadata": {}})  # fmt: skip
        samples.append(Sample(len(samples), f"{conversation['id']}_gen0", ids))
    write_jsonl(store, rows)
    extract = config["extract"]
    layer_ids = resolve_layer_ids(extract["layer_ids"], TARGET["num_hidden_layers"])
    settings = run_extraction_settings(config, read_target_model(target), layer_ids)
    hs_dir = run_dir / "hidden_states"
    journals: dict[int, list[str]] = {}
    for sample in samples:
        shard = layout.shard_of(sample.sample_id, extract["shards"])
        folder = layout.shard_dir(hs_dir, shard)
        folder.mkdir(parents=True, exist_ok=True)
        size = layout.hidden_state_bytes(TOKENS_PER_SAMPLE, len(layer_ids), TARGET["hidden_size"], settings.dtype, settings.storage)
        with (folder / layout.file_name(sample.sample_id)).open("wb") as stream:
            stream.truncate(size)  # sparse: its size, not its bytes
        record = layout.WrittenFile(sample.sample_id, sample.token_digest, TOKENS_PER_SAMPLE, size, "-")
        journals.setdefault(shard, [layout.journal_line({"settings_key": settings.key()})]).append(layout.journal_line(record))
    for shard, lines in journals.items():
        layout.journal_path(layout.shard_dir(hs_dir, shard)).write_text("\n".join(lines) + "\n")


def summary(plan) -> dict:
    stages = {s.name: s for s in plan.stages}
    pick = lambda name: {"hours": stages[name].seconds / 3600, "model_loads": stages[name].model_loads,  # noqa: E731
                         "kept": stages[name].reused, "computed": stages[name].computed}  # fmt: skip
    return {"samples": plan.tokens["samples"], "generate_server": pick("generate_server"), "extract_server": pick("extract_server"),
            "total_hours": plan.total_seconds / 3600, "total_gpu_hours": plan.total_gpu_hours}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scratch", type=Path, help="folder for the reference run (default: a temporary one)")
    parser.add_argument("--json", type=Path, help="write the numbers here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        workdir = Path(scratch)
        config, target = reference_folder(workdir)
        rates = load_rates(workdir / "rates.yaml", "cuda")
        run_dir = workdir / "results" / config["run"]
        # the earlier run's answer lengths, as its rates would give them (--rates results/<run>)
        known = replace(rates, response_tokens=TOKENS_PER_SAMPLE - PROMPT_TOKENS, prompt_tokens=PROMPT_TOKENS)
        before = summary(build_plan(config, run_dir, known, free_bytes=10**14, local_gpus=8))
        leave_the_first_run(workdir, config, target)
        after = summary(build_plan(config, run_dir, rates, free_bytes=10**14, local_gpus=8))
    result = {"grow": f"{BEFORE:,} -> {AFTER:,} samples", "rates": rates.source, "before": before, "after": after}
    for name in ("generate_server", "extract_server"):
        print(f"{name}: {before[name]['hours']:.2f} h before, {after[name]['hours']:.2f} h after "
              f"(kept {after[name]['kept']:,}, computed {after[name]['computed']:,})")  # fmt: skip
    print(f"whole run: {before['total_hours']:.2f} h before, {after['total_hours']:.2f} h after; "
          f"GPU-hours {before['total_gpu_hours']:.1f} before, {after['total_gpu_hours']:.1f} after")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
