"""Time the progress check on a synthetic 10,000-file, 64-shard extraction.

The run directory mimics config/examples/moe-1t-8gpu.yaml part-way through
stage 5: 64 shards of 188 samples (bfloat16, hidden 7168, 4 layer slots,
lognormal lengths up to 8192 tokens); 48 shards done, 8 running, 8 not
started, 10,000 files finished. Files are sparse (a real safetensors header,
then a hole up to the full size), so the ~3 TB it describes takes no disk.

    .venv/bin/python bench/progress_bench.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from draftflow.extract import layout
from draftflow.progress import Options, check

SHARDS, PER_SHARD, DONE_SHARDS, RUNNING_SHARDS, RUNNING_DONE = 64, 188, 48, 8, 122
HIDDEN, LAYER_IDS, BYTES_PER_VALUE = 7168, [2, 30, 58, 61], 2
TARGET = {"hidden_size": HIDDEN, "intermediate_size": 18432, "num_attention_heads": 64,
          "num_key_value_heads": 8, "head_dim": 112, "vocab_size": 163840}  # fmt: skip
LOAD_S, SECONDS_PER_TOKEN = 900.0, 1 / 2500


def safetensors_file(tokens: int) -> tuple[bytes, int]:
    """(header, full size) of an hs file: hidden_states [tokens, 4, 7168] bf16, token_ids [tokens] int64."""
    states = tokens * len(LAYER_IDS) * HIDDEN * BYTES_PER_VALUE
    header = json.dumps({
        "hidden_states": {"dtype": "BF16", "shape": [tokens, len(LAYER_IDS), HIDDEN], "data_offsets": [0, states]},
        "token_ids": {"dtype": "I64", "shape": [tokens], "data_offsets": [states, states + 8 * tokens]},
    }).encode()  # fmt: skip
    header += b" " * (-len(header) % 8)
    prefix = len(header).to_bytes(8, "little") + header
    return prefix, len(prefix) + states + 8 * tokens


def write_file(path: Path, tokens: int, finished_at: float) -> int:
    prefix, size = safetensors_file(tokens)
    with path.open("wb") as stream:
        stream.write(prefix)
        stream.truncate(size)
    os.utime(path, (finished_at, finished_at))
    return size


def stand_in_digest(sample_id: str, tokens: int) -> str:
    """A sample's token digest: the files hold no token ids (sparse), so a digest of stand-in ids."""
    return layout.token_digest([int(sample_id.removeprefix("s")), tokens])


def write_shard(hs_dir: Path, shard: int, samples: list[list], done: int, ready: float) -> None:
    """``samples``: the plan's [sample_id, tokens, token_digest] triples; the first ``done`` are on disk."""
    shard_dir = layout.shard_dir(hs_dir, shard)
    shard_dir.mkdir()
    clock, lines = ready, [json.dumps({"settings_key": "bench"})]
    for sample_id, tokens, digest in samples[:done]:
        clock += tokens * SECONDS_PER_TOKEN
        size = write_file(shard_dir / layout.file_name(sample_id), tokens, clock)
        lines.append(layout.journal_line(layout.WrittenFile(sample_id, digest, tokens, size, "-")))
    layout.journal_path(shard_dir).write_text("\n".join(lines) + "\n")
    status = "done" if done == len(samples) else "running"
    loads_model = shard < RUNNING_SHARDS  # each server job loads for its first shard only
    heartbeat = {"shard": shard, "pid": os.getpid(), "status": status, "loads_model": loads_model,
                 "started_at": ready - (LOAD_S if loads_model else 0),
                 "model_ready_at": ready, "updated_at": clock}  # fmt: skip
    layout.heartbeat_path(hs_dir, shard).write_text(json.dumps(heartbeat))
    if status == "done":
        layout.shard_manifest_path(hs_dir, shard).write_text(json.dumps({"shard": shard, "samples": done}))


def build(run_dir: Path, now: float) -> None:
    rng = random.Random(0)
    hs_dir = run_dir / "hidden_states"
    hs_dir.mkdir(parents=True)
    lengths = [min(8192, max(64, round(rng.lognormvariate(8.3, 0.6)))) for _ in range(SHARDS * PER_SHARD)]
    per_token = len(LAYER_IDS) * HIDDEN * BYTES_PER_VALUE + 8
    shards = [
        {"shard": k, "server": k % RUNNING_SHARDS,
         "samples": [[f"s{i}", lengths[i], stand_in_digest(f"s{i}", lengths[i])] for i in range(k, len(lengths), SHARDS)]}
        for k in range(SHARDS)
    ]  # fmt: skip
    for shard in shards:
        shard["bytes"] = sum(t * per_token + 256 for _, t, _ in shard["samples"])
    plan = {"num_shards": SHARDS, "servers": RUNNING_SHARDS, "layer_ids": LAYER_IDS, "hidden_size": HIDDEN, "dtype": "bfloat16",
            "samples": len(lengths), "tokens": sum(lengths), "bytes": sum(s["bytes"] for s in shards),
            "shards": shards, "disk": {}}  # fmt: skip
    (hs_dir / layout.PLAN).write_text(json.dumps(plan))
    wave_seconds = LOAD_S + 1.2 * max(sum(t for _, t, _ in s["samples"]) for s in shards) * SECONDS_PER_TOKEN
    for shard in shards[:DONE_SHARDS]:  # waves of eight shards side by side: eight single-GPU server jobs
        waves_ago = DONE_SHARDS // RUNNING_SHARDS - shard["shard"] // RUNNING_SHARDS
        write_shard(hs_dir, shard["shard"], shard["samples"], PER_SHARD, now - waves_ago * wave_seconds)
    for shard in shards[DONE_SHARDS : DONE_SHARDS + RUNNING_SHARDS]:
        busy = sum(t for _, t, _ in shard["samples"][:RUNNING_DONE]) * SECONDS_PER_TOKEN
        write_shard(hs_dir, shard["shard"], shard["samples"], RUNNING_DONE, now - 5 - busy)


def write_config(scratch: Path) -> Path:
    (scratch / "target").mkdir()
    (scratch / "target/config.json").write_text(json.dumps(TARGET))
    config = scratch / "config.yaml"
    config.write_text(f"run: bench\ndevice: cuda\ntarget: {{path: {scratch / 'target'}}}\n"
                      f"data: {{prompt_files: [{scratch / 'prompts.jsonl'}]}}\n"  # the schema requires it; never read here
                      "vocab: {draft_vocab_size: 32000}\ntrain: {epochs: 5}\n")  # fmt: skip
    return config


def time_cli(run_dir: Path, config: Path) -> tuple[float, subprocess.CompletedProcess]:
    command = [
        str(Path(sys.executable).with_name("draftflow")),
        "progress",
        str(run_dir),
        "--configfile",
        str(config),
        "--free-bytes",
        "1TB",
    ]
    started = time.perf_counter()
    process = subprocess.run(command, capture_output=True, text=True)
    return time.perf_counter() - started, process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="build the run directory in this (new) folder and keep it")
    args = parser.parse_args()
    scratch = args.keep or Path(tempfile.mkdtemp(prefix="progress-bench-"))
    run_dir = scratch / "results/bench"
    started = time.perf_counter()
    build(run_dir, time.time())
    built = time.perf_counter() - started
    config = write_config(scratch)
    runs = [time_cli(run_dir, config) for _ in range(3)]
    started = time.perf_counter()
    report = check(run_dir, Options(configs=(config,), free_bytes=10**12))
    in_process = time.perf_counter() - started
    print(runs[-1][1].stdout[-2200:])
    print(json.dumps({
        "files": report.samples_done, "shards": len(report.shards), "build_seconds": round(built, 1),
        "cli_seconds_first": round(runs[0][0], 3), "cli_seconds_best": round(min(t for t, _ in runs), 3),
        "check_seconds_in_process": round(in_process, 3), "exit_code": runs[-1][1].returncode,
    }))  # fmt: skip
    if not args.keep:
        shutil.rmtree(scratch)


if __name__ == "__main__":
    main()
