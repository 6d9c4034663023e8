"""Extraction throughput per backend on the demo, and the 10,000-sample dry-run time.

Run after `make demo` (it reads results/demo and resources/demo-target, or
the folder given as the argument):

    .venv/bin/python bench/extract_throughput.py [WORKDIR]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from draftflow.extract.backends import open_extractor
from draftflow.extract.shards import ExtractionSettings, load_samples, run_shard
from draftflow.io import read_json

REPO = Path(__file__).resolve().parents[1]
WORKDIR = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO
RESULTS = WORKDIR / "results/demo"
TARGET = WORKDIR / "resources/demo-target"


def backend_options() -> dict:
    return {
        "dtype": "float32", "device": "cpu", "trust_remote_code": False,
        "token_budget": 4096, "concurrency": 8, "max_retries": 3,
        "server": {
            "args": ["--dtype", "float32", "--max-model-len", "1024", "--enforce-eager"],
            "host": "127.0.0.1", "port": None, "health_timeout_s": 600,
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
        },
    }  # fmt: skip


def measure(backend: str, layer_ids: list[int], samples) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        settings = ExtractionSettings(backend, tuple(layer_ids), "float32", "bench")
        started = time.monotonic()
        records = run_shard(
            samples, 0, scratch / "shard-0", scratch / "heartbeat.json", settings,
            lambda: open_extractor(backend, str(TARGET), layer_ids, backend_options(), scratch / "server.log"),
        )  # fmt: skip
        total = time.monotonic() - started
        heartbeat = read_json(scratch / "heartbeat.json")
    extracting = heartbeat["updated_at"] - heartbeat["model_ready_at"]
    tokens = sum(r.tokens for r in records)
    written = sum(r.bytes for r in records)
    return {
        "backend": backend,
        "samples": len(records),
        "tokens": tokens,
        "load_seconds": round(total - extracting, 1),
        "extract_seconds": round(extracting, 2),
        "tokens_per_second": round(tokens / extracting, 1),
        "bytes_per_token": round(written / tokens, 1),
    }


def dry_run_seconds() -> float:
    """`snakemake -n` on the 10,000-sample, 64-shard example (stand-in paths)."""
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        config = yaml.safe_load((REPO / "config/examples/moe-1t-8gpu.yaml").read_text())
        (scratch / "target").mkdir()
        (scratch / "target/config.json").write_text(json.dumps({"num_hidden_layers": 61}))
        (scratch / "prompts.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
        config["target"]["path"] = str(scratch / "target")
        config["data"]["prompt_files"] = [str(scratch / "prompts.jsonl")]
        (scratch / "config.yaml").write_text(yaml.safe_dump(config))
        snakemake = Path(sys.executable).with_name("snakemake")
        command = [str(snakemake), "-n", "--snakefile", str(REPO / "Snakefile"), "--directory", str(scratch),
                   "--configfile", str(scratch / "config.yaml")]  # fmt: skip
        started = time.monotonic()
        subprocess.run(command, check=True, capture_output=True)
        return time.monotonic() - started


def main() -> None:
    layer_ids = read_json(RESULTS / "hidden_states/plan.json")["layer_ids"]
    samples = load_samples(RESULTS / "prepared/dataset")
    for backend in ("transformers", "vllm"):
        print(json.dumps(measure(backend, layer_ids, samples)))
    print(json.dumps({"dry_run_10000_samples_64_shards_seconds": round(dry_run_seconds(), 2)}))


if __name__ == "__main__":
    main()
