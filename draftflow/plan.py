"""The plan: what a run will cost, stage by stage, before it starts.

    draftflow plan --configfile config.yaml [--rates results/<earlier run> | --rates rates.yaml]

Per stage: jobs, GPUs per job, model loads, bytes written, wall time and
GPU-hours; totals and the disk the run fills against the free space, with
warnings. The config's samples come from its prompts, read as the prompts
stage reads them; their tokens are exact for the conversations an earlier run
of the folder answered with the same target and settings (the answer store),
estimated for the rest from those answers, or from the prompts and
``generate.max_tokens``. Generation is planned for the conversations not
answered before, extraction for the samples whose hidden-state files no shard
journal vouches for: an edit is planned as the rerun it causes. Where the
prompt files cannot be read (a plan made away from the data), counts come
from the stage outputs' stats. Rates come from an earlier run (its ``benchmarks/``
and stage outputs), a rates file (the fields of :class:`Rates`) or
:data:`DEFAULT_RATES`. The plan keys answers by the target's identity
(``draftflow.fingerprint``), so it hashes weights edited since their last hash,
and warns where that reads more than a GiB. Standard library and PyYAML only
(tqdm for that hash's bar).

Exit codes as the progress check's: 0 fits, 3 will not fit; 1 when a file it
needs is missing, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from dataclasses import asdict, dataclass, field, fields, replace
from itertools import chain
from pathlib import Path

import yaml

from draftflow import run_folder
from draftflow.answers import (
    JOB_RECORDS,
    conversation_key,
    job_records,
    store_files,
    stored_answers,
    stored_rows,
)
from draftflow.config import load_config
from draftflow.costs import (
    fidelity_reference_bytes,
    hidden_states_bytes,
    later_stage_bytes,
    tree_bytes,
    vocab_map_bytes,
)
from draftflow.extract import layout
from draftflow.extract.fidelity import decide_for_config, fidelity_jobs
from draftflow.extract.layout import ExtractionSettings, Sample
from draftflow.dependencies import run_extraction_settings, run_generation_key
from draftflow.chat_template import flag_value
from draftflow.fingerprint import LARGE_HASH_BYTES, uncached_weight_bytes
from draftflow.gpus import local_gpu_count, local_gpu_memory_bytes
from draftflow.io import iter_jsonl, read_json, write_text
from draftflow.job_placement import concurrent_servers, server_gpus
from draftflow.layers import resolve_layer_ids
from draftflow.prepared_rows import PrepareStats, prepared_token_ids, select_rows
from draftflow.prompt_sources import config_sources, source_files
from draftflow.prompts import config_selection
from draftflow.report import read_benchmark
from draftflow.target_model import TargetModel, read_target_model
from draftflow.target_source import resolve_target
from draftflow.units import fmt_bytes, fmt_duration, size_argument

FITS, WILL_NOT_FIT = 0, 3
# Stages whose time the plan models from the data's size; the others' it takes as measured.
SIZED_STAGES = ("generate_server", "prepare", "extract_server", "train")
MEASURED_STAGES = tuple(stage.rule for stage in run_folder.STAGES if stage.rule not in SIZED_STAGES)
LOAD_SHARE_WARNING = 0.25
SERVER_COUNTS = {"generate_server": "generate.servers", "extract_server": "extract.servers"}  # the config key of each
CHARS_PER_TOKEN = 4  # prompts not yet tokenized: a common rule of thumb for English text
# The GPU fit: the share of each GPU's memory vLLM takes (its --gpu-memory-utilization
# default), and what a server needs there beside the weights and the KV cache (activations,
# CUDA graphs, the sampler's buffers): an estimate, not a measurement.
VLLM_GPU_MEMORY_UTILIZATION = 0.9
RUNTIME_RESERVE_BYTES = 2 * 1024**3
UNFIT = "will not fit"  # how the warnings of a run that cannot run begin


@dataclass(frozen=True)
class Rates:
    """How fast a run goes; one job each, model loads apart."""

    source: str
    # None (CUDA's defaults): scaled to the target from the GPU measurements (``on_target``)
    model_load_s: float | None  # a server's start until it serves (weights, compile, warm-up)
    generate_tokens_per_s: float | None  # response tokens, one generation server
    prepare_tokens_per_s: float
    extract_tokens_per_s: float | None  # one extraction server job
    train_tokens_per_s: float | None  # prepared tokens x epochs per second and per GPU (or CPU job) of training
    stage_seconds: dict[str, float] = field(default_factory=dict)  # MEASURED_STAGES, as measured
    generated_bytes_per_token: float = 37.0  # synthetic/ per prepared token (demo)
    prepared_bytes_per_token: float = 13.3  # prepared/ per prepared token (demo)
    response_tokens: float | None = None  # mean per sample; None: generate.max_tokens (an upper bound)
    prompt_tokens: float | None = None  # mean per sample; None: from the prompts' characters


# Sources: "cpu" is this repository's demo on 2 cores (make test, 2026-11-30; the two
# fidelity jobs 2026-12-03; the generation gather 2026-12-05); "cuda" scales its
# model load, extraction and training to the target from the GPU measurements below
# (``on_target``).
# Rates from your own earlier run (--rates results/<run>) replace all of them.
DEFAULT_RATES = {
    "cpu": Rates("defaults: the demo on 2 CPU cores", 20.0, 765.0, 2230.0, 540.0, 3000.0,
                 {"prompts": 0.1, "generate": 6.6, "vocab_map": 7.6, "extract_plan": 2.3, "extract": 2.0, "fidelity_reference": 8.1,
                  "fidelity": 3.2, "drafter_init": 13.4, "train_views": 2.0, "evaluate": 7.6, "serve_check": 25.0,
                  "report": 0.5, "provenance": 0.1}),
    "cuda": Rates("defaults: GPU measurements scaled to the target", None, None, 20000.0, None, None,
                  {"prompts": 1.0, "generate": 120.0, "vocab_map": 60.0, "extract_plan": 60.0, "extract": 10.0, "fidelity_reference": 600.0,
                   "fidelity": 60.0, "drafter_init": 120.0, "train_views": 60.0, "evaluate": 600.0, "serve_check": 1800.0,
                   "report": 5.0, "provenance": 1.0}),
}  # fmt: skip


# The GPU measurements (BENCHMARKS.md) CUDA's defaults scale from. Extraction: 39,179
# tokens/s on one H200 for a target of Llama-3.1-8B's shape (7.50B parameters per token, as
# TargetModel.parameters_per_token counts them; transformers backend, 2026-12-04), bound by
# compute: a target's rate goes as the inverse of its parameters per token and with its
# server's GPUs. Training: speculators' Trainer, that target's drafter (hidden 4,096) at
# 36,442 tokens/s per H200 (2026-11-29): a drafter's layers go as its hidden size squared.
# A server's start: 130 s on an H100 for a 115M-parameter target (its first start, kernels
# built; 2026-12-07), or the 1T reference run's (issue 14, not measured here: 594 GB of
# weights in 24.5 minutes) scaled by the weights' bytes, whichever is longer. Generation:
# vLLM 0.26.0 on one H100 answering a target of Llama-3.1-8B's shape (random weights,
# 256-token prompts, 512-token answers; bench/gpu/generation_rate.py, 2026-12-07) at three
# concurrencies: a decode step reads every weight once for all the requests in flight, so
# the rate rises with them (as them below the first measured) and goes as the inverse of the
# parameters per token; between measured concurrencies it is interpolated, past the last held.
MEASURED_EXTRACTION = (39179.0, 7_504_658_432, "39,179 tokens/s at 7.50B parameters per token on one H200")
MEASURED_TRAINING = (36442.0, 4096, "36,442 tokens/s per H200 at hidden size 4,096")
MEASURED_SERVER_START_S = 130.0
REFERENCE_LOAD = (1470.0, 594e9)  # seconds, weight bytes
MEASURED_GENERATION = ({16: 2315.7, 64: 7225.0, 256: 14583.4}, 7_504_658_432, "on one H100 at 7.50B parameters per token")


def measured_generation_rate(concurrency: int) -> float:
    """MEASURED_GENERATION's response tokens/s at ``concurrency`` requests in flight: in
    proportion below the first measured, log-linear between two, the last's above it."""
    points = sorted(MEASURED_GENERATION[0].items())
    if concurrency <= points[0][0]:
        return points[0][1] * concurrency / points[0][0]
    for (low, low_rate), (high, high_rate) in zip(points, points[1:]):
        if concurrency <= high:
            share = math.log(concurrency / low) / math.log(high / low)
            return low_rate + share * (high_rate - low_rate)
    return points[-1][1]


def on_target(rates: Rates, target: TargetModel, config: dict) -> tuple[Rates, list[str]]:
    """``rates`` with what is left to scale (None) scaled to ``target``, and a line for each
    saying from what."""
    gpus = max(1, server_gpus(config))
    scaled, notes = {}, []
    if rates.extract_tokens_per_s is None:
        measured, parameters, what = MEASURED_EXTRACTION
        scaled["extract_tokens_per_s"] = measured * parameters / target.parameters_per_token * gpus
        notes.append(f"extraction {scaled['extract_tokens_per_s']:,.0f} tokens/s per server job: {what} (BENCHMARKS.md), "
                     f"scaled to this target's {target.parameters_per_token / 1e9:.2f}B on {gpus} GPU(s)")  # fmt: skip
    if rates.train_tokens_per_s is None:
        measured, hidden, what = MEASURED_TRAINING
        scaled["train_tokens_per_s"] = measured * (hidden / target.hidden_size) ** 2
        notes.append(f"training {scaled['train_tokens_per_s']:,.0f} tokens/s per GPU: {what} (BENCHMARKS.md), "
                     f"scaled to this drafter's {target.hidden_size:,}")  # fmt: skip
    if rates.model_load_s is None:
        seconds, weight_bytes = REFERENCE_LOAD
        from_weights = seconds * (target.weight_bytes or 0) / weight_bytes
        scaled["model_load_s"] = max(MEASURED_SERVER_START_S, from_weights)
        notes.append(f"a server's start {fmt_duration(scaled['model_load_s'])}: the longer of a measured start on an H100 "
                     f"({MEASURED_SERVER_START_S:.0f} s, a 115M target) and the 1T reference run's 24.5 minutes scaled "
                     f"to these weights ({fmt_duration(from_weights)}; not measured here)")  # fmt: skip
    if rates.generate_tokens_per_s is None:
        concurrency = config["generate"]["concurrency"]
        at_concurrency = measured_generation_rate(concurrency)
        _, parameters, what = MEASURED_GENERATION
        scaled["generate_tokens_per_s"] = at_concurrency * parameters / target.parameters_per_token * gpus
        notes.append(f"generation {scaled['generate_tokens_per_s']:,.0f} response tokens/s per server: {at_concurrency:,.0f} "
                     f"at generate.concurrency {concurrency} {what} (BENCHMARKS.md), scaled to this target's "
                     f"{target.parameters_per_token / 1e9:.2f}B on {gpus} GPU(s)")  # fmt: skip
    return replace(rates, **scaled), notes


@dataclass(frozen=True)
class Stage:
    name: str
    jobs: int
    gpus_per_job: int
    model_loads: int
    bytes_written: int
    seconds: float  # the stage's wall time
    gpu_hours: float
    load_seconds: float  # of ``seconds``, spent loading models
    reused: int | None = None  # generate: conversations answered before; extract_server: samples extracted before
    computed: int | None = None  # ... and those this run asks or extracts


@dataclass(frozen=True)
class GpuFit:
    """What a server needs on each of its GPUs, against what vLLM takes of one."""

    gpu_bytes: int  # one GPU's memory
    source: str  # where that figure comes from
    usable_bytes: int  # vLLM's share of it (--gpu-memory-utilization)
    weight_bytes: int  # the target's weights over vllm.tensor_parallel_size
    kv_cache_bytes: int  # one vllm.max_model_len sequence's keys and values
    reserve_bytes: int  # RUNTIME_RESERVE_BYTES
    needed_bytes: int
    fits: bool


@dataclass(frozen=True)
class Plan:
    run: str
    tokens: dict  # samples, tokens, source
    rates: str
    stages: list[Stage]
    total_bytes: int
    peak_bytes: int
    free_bytes: int
    free_source: str
    total_seconds: float
    total_gpu_hours: float
    warnings: list[str]
    exit_code: int
    gpu_fit: GpuFit | None = None  # device cuda with a GPU memory known: vllm.gpu_memory_gib or the GPUs here
    rate_notes: list[str] = field(default_factory=list)  # the defaults scaled to the target: from what


# -- rates ----------------------------------------------------------------------


def rates_from_run(run_dir: Path) -> Rates:
    """Rates measured by an earlier run: ``results/<run>`` beside its ``benchmarks/<run>``."""
    run_dir = Path(run_dir)
    benchmarks = run_folder.benchmarks_dir(run_dir)
    seconds = {path.stem: read_benchmark(path)["seconds"] for path in benchmarks.glob("*.tsv")}
    generated, prepared = read_json(run_folder.stage_dir(run_dir, "generate") / "stats.json"), read_json(run_folder.stage_dir(run_dir, "prepare") / "stats.json")
    extracted = read_json(run_folder.hidden_states_dir(run_dir) / layout.SUMMARY)
    trained = read_json(run_folder.stage_dir(run_dir, "train") / "stats.json")
    loads = [
        h["model_ready_at"] - h["started_at"]
        for path in layout.heartbeats(run_folder.hidden_states_dir(run_dir))
        if (h := read_json(path)).get("loads_model") and h.get("model_ready_at")
    ]
    jobs = generation_jobs(run_dir)
    if not jobs:
        raise ValueError(
            f"{run_dir} holds no generation job records ({run_folder.stage_dir(run_dir, 'generate').name}/"
            f"{JOB_RECORDS}/): a run of a draftflow before generate.servers. Give its rates as a YAML file of "
            "draftflow.plan.Rates' fields instead (--rates FILE)."
        )
    asking = [job for job in jobs if job["conversations_asked"]] or jobs  # a job that asks nothing starts no server
    job_seconds = [seconds[f"generate_server-{job['server']}"] for job in asking]
    load = sum(loads) / len(loads) if loads else sum(s - job["seconds"] for s, job in zip(job_seconds, asking)) / len(asking)
    servers = [s for name, s in seconds.items() if name.startswith("extract_server-")]
    return Rates(
        source=f"measured by {run_dir}",
        model_load_s=load,
        generate_tokens_per_s=generated_tokens(generated) / max(sum(job_seconds) - len(asking) * load, 1e-9),
        prepare_tokens_per_s=prepared["tokens"] / seconds["prepare"],
        extract_tokens_per_s=extracted["tokens"] / max(sum(servers) - len(loads or servers) * load, 1e-9),
        train_tokens_per_s=prepared["tokens"] * trained["epochs"] / seconds["train"] / max(1, trained["gpus"]),
        stage_seconds={stage: seconds[stage] for stage in MEASURED_STAGES if stage in seconds},
        generated_bytes_per_token=tree_bytes(run_folder.stage_dir(run_dir, "generate")) / prepared["tokens"],
        prepared_bytes_per_token=tree_bytes(run_folder.stage_dir(run_dir, "prepare")) / prepared["tokens"],
        response_tokens=generated["mean_response_tokens"],
        prompt_tokens=generated["mean_prompt_tokens"],
    )


def generation_jobs(run_dir: Path) -> list[dict]:
    """Each generation job's record of its share (``generate.answer_share``)."""
    return [read_json(path) for path in sorted(job_records(run_folder.stage_dir(run_dir, "generate")))]


def generated_tokens(stats: dict) -> int:
    """The response tokens the run's own generation produced: the answers it asked,
    not those it found stored (all of them in a run made before the answer store)."""
    return stats.get("response_tokens_generated") or stats["response_tokens"]


def load_rates(source: Path | None, device: str) -> Rates:
    if source is None:
        return DEFAULT_RATES[device]
    if Path(source).is_dir():
        return rates_from_run(Path(source))
    given = yaml.safe_load(Path(source).read_text())
    known = {f.name for f in fields(Rates)}
    if unknown := set(given) - known:
        raise ValueError(f"{source}: unknown rate(s) {sorted(unknown)}; known: {sorted(known - {'source'})}")
    return replace(DEFAULT_RATES[device], source=f"{source} (defaults for the rest)", **given)


# -- work -------------------------------------------------------------------------


def message_chars(conversation: dict) -> int:
    return sum(len(turn["content"]) for turn in conversation["messages"])


def sampled_conversations(config: dict, run_dir: Path) -> list[dict]:
    """The conversations the prompts stage sampled, or would sample: read as it reads
    them (bad rows as ``data.on_bad_row`` says, duplicates dropped)."""
    sampled = run_folder.stage_dir(run_dir, "prompts") / "conversations.jsonl"
    if sampled.exists():
        return list(iter_jsonl(sampled))
    return config_selection(config).rows


def work_from_stats(config: dict, run_dir: Path, rates: Rates) -> dict:
    """Samples and tokens from the outputs' stats, all of them to compute: exact after
    prepare, else the best estimate the run allows."""
    prepared = run_folder.stage_dir(run_dir, "prepare") / "stats.json"
    if prepared.exists():
        stats = read_json(prepared)
        return all_to_compute({"samples": stats["kept"], "tokens": stats["tokens"], "response_tokens": stats["supervised_tokens"],
                               "source": "exact: prepare's token counts"})  # fmt: skip
    samples = config["data"]["num_samples"]
    generated = run_folder.stage_dir(run_dir, "generate") / "stats.json"
    if generated.exists():
        stats = read_json(generated)
        samples, prompt, response = stats["samples"], stats["mean_prompt_tokens"], stats["mean_response_tokens"]
        source = "estimated: generate's mean tokens"
    else:
        prompt = rates.prompt_tokens
        if prompt is None:
            conversations = sampled_conversations(config, run_dir)
            prompt = sum(map(message_chars, conversations)) / max(len(conversations), 1) / CHARS_PER_TOKEN
            samples = len(conversations)
        response, source = response_estimate(config, rates)
    per_sample = min(prompt + response, config["prepare"]["max_seq_length"])
    return all_to_compute({"samples": samples, "tokens": round(samples * per_sample),
                           "response_tokens": round(samples * response), "source": source})  # fmt: skip


def response_estimate(config: dict, rates: Rates) -> tuple[float, str]:
    if rates.response_tokens is not None:
        return rates.response_tokens, "estimated: prompt lengths and the earlier run's answers"
    return config["generate"]["max_tokens"], "estimated: prompt lengths and generate.max_tokens (an upper bound)"


def all_to_compute(work: dict) -> dict:
    return work | {"conversations": work["samples"], "answered_before": 0, "to_ask": work["samples"],
                   "response_tokens_to_generate": work["response_tokens"], "extracted_before": 0,
                   "to_extract": work["samples"], "tokens_to_extract": work["tokens"]}  # fmt: skip


def token_counts(config: dict, run_dir: Path, rates: Rates, target: TargetModel, layer_ids: list[int]) -> dict:
    """The config's samples and tokens, and of them the work earlier runs of the folder left
    that this run keeps: answers (the answer store) and hidden-state files (the shard journals)."""
    base = run_dir.parents[1]
    if not all(Path(file).exists() for file in source_files([*chain(*config_sources(config, base))])):
        return work_from_stats(config, run_dir, rates)
    prepare = config["prepare"]
    conversations = config_selection(config, base).rows
    answers = stored_answers(store_files(run_folder.stage_dir(run_dir, "generate") / "work", run_generation_key(config, target)))
    new = [c for c in conversations if conversation_key(c) not in answers]
    rows = stored_rows(answers, conversations)
    max_length = prepare["max_seq_length"]
    kept = select_rows(rows, max_length, prepare["minimum_valid_tokens"], prepare["on_too_long"], PrepareStats())
    known = [Sample(row, r["id"], prepared_token_ids(r, max_length)) for row, r in enumerate(kept)]
    if rows:
        response = sum(sum(r["loss_mask"]) for r in rows) / len(rows)
        source = f"exact for the {len(known)} samples answered before" + (
            f"; {len(new)} new conversations estimated from their answers" if new else ""
        )
    else:
        response, source = response_estimate(config, rates)
    new_tokens = [min(message_chars(c) / CHARS_PER_TOKEN + response, max_length) for c in new]
    settings = run_extraction_settings(config, target, layer_ids)
    reused = extracted_before(run_folder.hidden_states_dir(run_dir), settings, known, config["extract"]["shards"])
    tokens = sum(len(s.token_ids) for s in known)
    return {
        "samples": len(known) + len(new),
        "tokens": tokens + round(sum(new_tokens)),
        "response_tokens": sum(sum(r["loss_mask"][:max_length]) for r in kept) + round(len(new) * response),
        "source": source,
        "conversations": len(conversations),
        "answered_before": len(conversations) - len(new),
        "to_ask": len(new),
        "response_tokens_to_generate": round(len(new) * response),
        "extracted_before": len(reused),
        "to_extract": len(known) + len(new) - len(reused),
        "tokens_to_extract": tokens - sum(len(s.token_ids) for s in known if s.sample_id in reused) + round(sum(new_tokens)),
        "cut_at_max_tokens": sum(row.get("metadata", {}).get("finish_reason") == "length" for row in rows),
    }


def extracted_before(hs_dir: Path, settings: ExtractionSettings, samples: list[Sample], num_shards: int) -> set[str]:
    """The samples whose hidden-state files a shard journal vouches for (layout.vouched_files)."""
    return {
        sample_id
        for shard in range(num_shards)
        for sample_id in layout.vouched_files(
            layout.shard_dir(hs_dir, shard), settings.key(), layout.shard_samples(samples, shard, num_shards)
        )
    }


# -- the plan -----------------------------------------------------------------------


def plan_stages(config: dict, target: TargetModel, num_layer_ids: int, work: dict, later: dict[str, int], rates: Rates,
                run_dir: Path, local_gpus: int | None, checked: bool) -> list[Stage]:  # fmt: skip
    """``later``: the bytes of the outputs after extraction, in the end (costs.later_stage_bytes);
    ``checked``: whether the fidelity check runs."""
    gpus, samples, tokens = server_gpus(config), work["samples"], work["tokens"]
    shards = config["extract"]["shards"]
    servers, _ = concurrent_servers(config["extract"]["servers"], shards, gpus, local_gpus)
    at_once = servers if local_gpus is None or gpus == 0 else max(1, min(servers, local_gpus // gpus))
    hidden_bytes = hidden_states_bytes(
        samples, tokens, num_layer_ids, target.hidden_size, config["target"]["dtype"], config["extract"]["storage"]
    )
    measured = lambda name: rates.stage_seconds.get(name, 0.0)  # noqa: E731
    load = rates.model_load_s
    extract_loads = servers if work["to_extract"] else 0  # a server job with nothing to extract loads nothing
    per_server = (load if extract_loads else 0.0) + work["tokens_to_extract"] / servers / rates.extract_tokens_per_s
    extract_wall = math.ceil(servers / at_once) * per_server
    # generation: each job asks an even share (a hash of each conversation's content)
    generators = config["generate"]["servers"]
    generate_gpus = 0 if config["generate"]["endpoint"] else gpus
    generators_at_once = generators if local_gpus is None or generate_gpus == 0 else max(1, min(generators, local_gpus // generate_gpus))
    starts_server = bool(work["to_ask"]) and not config["generate"]["endpoint"]  # nothing to ask: no server starts
    generate_load = load if starts_server else 0.0
    per_generator = generate_load + work["response_tokens_to_generate"] / generators / rates.generate_tokens_per_s
    rounds = math.ceil(generators / generators_at_once)
    train_gpus = config["train"]["gpus"] if config["device"] == "cuda" else 0
    serve = config["evaluate"]["serve_check"]
    fidelity = fidelity_jobs(config, checked, gpus)
    reference_bytes = fidelity_reference_bytes(
        samples, tokens, config["extract"]["fidelity_samples"] if checked else 0, num_layer_ids, target.hidden_size,
        config["target"]["dtype"],
    )  # fmt: skip

    def stage(name, jobs, gpus_per_job, loads, written, seconds, gpu_seconds=None, load_seconds=0.0, reuse=(None, None)) -> Stage:
        gpu_seconds = seconds * gpus_per_job * jobs if gpu_seconds is None else gpu_seconds
        return Stage(name, jobs, gpus_per_job, loads, int(written), seconds, gpu_seconds / 3600, load_seconds, *reuse)

    stages = [
        stage("prompts", 1, 0, 0, existing_or(run_folder.stage_dir(run_dir, "prompts"), 0), measured("prompts")),
        stage("generate_server", generators, generate_gpus, generators * starts_server,
              existing_or(run_folder.stage_dir(run_dir, "generate"), rates.generated_bytes_per_token * tokens),
              rounds * per_generator, gpu_seconds=generators * generate_gpus * per_generator,
              load_seconds=rounds * generate_load, reuse=(work["answered_before"], work["to_ask"])),
        stage("generate", 1, 0, 0, 0, measured("generate")),
        stage("prepare", 1, 0, 0, existing_or(run_folder.stage_dir(run_dir, "prepare"), rates.prepared_bytes_per_token * tokens),
              tokens / rates.prepare_tokens_per_s),
        stage("vocab_map", 1, 0, 0, vocab_map_bytes(target.vocab_size, config["vocab"]["draft_vocab_size"]),
              measured("vocab_map")),
        stage("extract_plan", 1, 0, 0, 0, measured("extract_plan")),
        stage("fidelity_reference", 1, *fidelity["fidelity_reference"], reference_bytes,
              measured("fidelity_reference") if checked else 0.0),
        stage("extract_server", servers, gpus, extract_loads, hidden_bytes, extract_wall,
              gpu_seconds=servers * gpus * per_server, load_seconds=math.ceil(servers / at_once) * load * bool(extract_loads),
              reuse=(work["extracted_before"], work["to_extract"])),
        stage("extract", 1, 0, 0, 0, measured("extract")),
        stage("fidelity", 1, *fidelity["fidelity"], 0, measured("fidelity") if checked else 0.0),
        stage("drafter_init", 1, 0, 0, later["untrained drafter"], measured("drafter_init")),
        stage("train_views", 1, 0, 0, later["training views"], measured("train_views")),
        stage("train", 1, train_gpus, 0, later["drafter"] + later["training checkpoints"],
              tokens * config["train"]["epochs"] / rates.train_tokens_per_s / max(1, train_gpus)
              + selection_seconds(config["train"], tokens / max(1, samples), rates.train_tokens_per_s)),
        stage("evaluate", 1, 0, 0, later["evaluation and report"], measured("evaluate")),
    ]  # fmt: skip
    if serve:
        stages.append(stage("serve_check", 1, gpus, 1, 0, measured("serve_check")))
    return stages + [stage("report", 1, 0, 0, 0, measured("report")), stage("provenance", 1, 0, 0, 0, measured("provenance"))]


def selection_seconds(train: dict, tokens_per_sample: float, train_tokens_per_s: float) -> float:
    """Measuring each epoch's drafter on train.selection_samples held-out samples: a forward
    pass, about a third of a training step's work a token (draftflow.epoch_selection)."""
    return train["epochs"] * train["selection_samples"] * tokens_per_sample / (3 * train_tokens_per_s)


def gpu_fit(config: dict, target: TargetModel, local_memory=local_gpu_memory_bytes) -> GpuFit | None:
    """The target on the GPUs of one server (vllm.tensor_parallel_size of them): its weights
    split over them, one vllm.max_model_len sequence's KV cache and the runtime's reserve each,
    against vLLM's share of a GPU of vllm.gpu_memory_gib (else of the GPUs here, asked of
    ``local_memory()`` only then). None on CPU, without a GPU memory to check against, or
    without weights to weigh."""
    vllm = config["vllm"]
    if config["device"] != "cuda" or target.weight_bytes is None:
        return None
    given = vllm["gpu_memory_gib"]
    gpu_bytes, source = (round(given * 1024**3), "vllm.gpu_memory_gib") if given else (local_memory(), "the GPUs here")
    if not gpu_bytes:
        return None
    share = float(flag_value(vllm["extra_args"], "--gpu-memory-utilization") or VLLM_GPU_MEMORY_UTILIZATION)
    tp = vllm["tensor_parallel_size"]
    weights = math.ceil(target.weight_bytes / tp)
    kv = vllm["max_model_len"] * target.kv_cache_bytes_per_token(layout.DTYPE_BYTES[config["target"]["dtype"]], tp)
    needed = weights + kv + RUNTIME_RESERVE_BYTES
    usable = int(gpu_bytes * share)
    return GpuFit(gpu_bytes, source, usable, weights, kv, RUNTIME_RESERVE_BYTES, needed, needed <= usable)


def gpu_fit_warning(config: dict, fit: GpuFit) -> str:
    """Why the target does not fit its GPUs, and the ways out."""
    tp, length = config["vllm"]["tensor_parallel_size"], config["vllm"]["max_model_len"]
    per_gpu = max(1, fit.usable_bytes - fit.reserve_bytes - fit.kv_cache_bytes)
    return (
        f"{UNFIT} the GPUs: each of a server's {tp} GPU(s) would hold {fmt_bytes(fit.weight_bytes)} of weights, "
        f"{fmt_bytes(fit.kv_cache_bytes)} of KV cache for one {length:,}-token sequence and {fmt_bytes(fit.reserve_bytes)} "
        f"for the runtime, {fmt_bytes(fit.needed_bytes)} in all, where vLLM takes {fmt_bytes(fit.usable_bytes)} of "
        f"{fmt_bytes(fit.gpu_bytes)} ({fit.source}). Ways out: more GPUs per server (vllm.tensor_parallel_size "
        f"{math.ceil(fit.weight_bytes * tp / per_gpu)} or more, if the target splits so), a quantised checkpoint, or a "
        "shorter vllm.max_model_len"
    )


def existing_or(path: Path, estimate: float) -> float:
    """What an output already holds (measured), else the estimate."""
    return tree_bytes(path) if path.exists() else estimate


def build_plan(config: dict, run_dir: Path, rates: Rates, free_bytes: int | None = None, local_gpus: int | None = None) -> Plan:
    """The plan of ``config``'s run, whose outputs go to ``run_dir`` (``<working directory>/results/<run>``)."""
    in_workdir = run_dir.parents[1] / config["target"]["path"]  # results/<run> sits in the working directory
    target = read_target_model(in_workdir if in_workdir.is_dir() else resolve_target(config["target"]["path"]).folder)
    rates, rate_notes = on_target(rates, target, config)
    checked = decide_for_config(config, target.weight_bytes).check
    layer_ids = resolve_layer_ids(config["extract"]["layer_ids"], target.num_layers)
    num_layer_ids = len(layer_ids)
    unhashed = uncached_weight_bytes(target.folder)  # counted before token_counts hashes them (the answers' key)
    work = token_counts(config, run_dir, rates, target, layer_ids)
    views = round(rates.prepared_bytes_per_token * work["tokens"])
    later, at_peak = (later_stage_bytes(config, target, num_layer_ids, views, peak=peak) for peak in (False, True))
    stages = plan_stages(config, target, num_layer_ids, work, later, rates, run_dir, local_gpus, checked)
    total = sum(s.bytes_written for s in stages)
    peak = total + sum(at_peak.values()) - sum(later.values())
    disk = run_dir if run_dir.exists() else Path.cwd()
    free = shutil.disk_usage(disk).free if free_bytes is None else free_bytes
    fit = gpu_fit(config, target)
    unfit = [gpu_fit_warning(config, fit)] if fit and not fit.fits else []
    warnings = unfit + plan_warnings(config, work, stages, peak, free, local_gpus) + hashing_warning(unhashed)
    return Plan(
        run=config["run"],
        tokens=work,
        rates=rates.source,
        rate_notes=rate_notes,
        stages=stages,
        total_bytes=total,
        peak_bytes=peak,
        free_bytes=free,
        free_source="measured" if free_bytes is None else "--free-bytes",
        total_seconds=sum(s.seconds for s in stages),
        total_gpu_hours=sum(s.gpu_hours for s in stages),
        warnings=warnings,
        exit_code=WILL_NOT_FIT if peak > free or unfit else FITS,
        gpu_fit=fit,
    )


def plan_warnings(config: dict, work: dict, stages: list[Stage], peak: int, free: int, local_gpus: int | None) -> list[str]:
    warnings = []
    if peak > free:
        warnings.append(
            f"{UNFIT}: the run writes up to {fmt_bytes(peak)}, {fmt_bytes(free)} are free "
            f"({fmt_bytes(peak - free)} short); free space, use a larger disk, or lower data.num_samples "
            "or prepare.max_seq_length"
        )
    for stage in stages:
        if stage.model_loads and stage.seconds and stage.load_seconds > LOAD_SHARE_WARNING * stage.seconds:
            warnings.append(
                f"{stage.name}: model loads take {fmt_duration(stage.load_seconds)} of its {fmt_duration(stage.seconds)}"
                + (f" (fewer {SERVER_COUNTS[stage.name]} load fewer times)" if stage.name in SERVER_COUNTS and stage.jobs > 1 else "")
            )
    if work.get("cut_at_max_tokens") and work["to_ask"]:
        generate = config["generate"]
        warnings.append(
            f"generate.max_tokens {generate['max_tokens']}: {work['cut_at_max_tokens']} of the answers so far were cut "
            f"there (of {work['answered_before']} conversations answered); a cut answer is flawed, generation fails above generate.max_degenerate_fraction "
            f"{generate['max_degenerate_fraction']:.0%} of flawed answers, and raising max_tokens asks every conversation "
            "again (it keys the answer store): raise it before the run, as thinking answers need"
        )
    shards, servers = config["extract"]["shards"], config["extract"]["servers"]
    if shards > work["samples"]:
        warnings.append(f"extract.shards ({shards}) is more than the samples ({work['samples']}): some shards stay empty")
    if servers is not None and servers > shards:
        warnings.append(f"extract.servers ({servers}) is more than extract.shards ({shards}): only {shards} server jobs run")
    node = local_gpus if local_gpus else None
    for stage in stages:
        if node is not None and stage.gpus_per_job > node:
            warnings.append(f"{stage.name}: {stage.gpus_per_job} GPUs per job, but a node here has {node}")
    return warnings


def hashing_warning(unhashed_bytes: int) -> list[str]:
    """Word of a large target read whole now (draftflow.fingerprint): its weights not hashed since they last changed."""
    if unhashed_bytes <= LARGE_HASH_BYTES:
        return []
    return [f"hashing {fmt_bytes(unhashed_bytes)} of the target's weights once, to see any edit of them "
            "(cached after: later plans and runs read none of them)"]  # fmt: skip


def write_plan(config: dict, target: Path, run_dir: Path, local_gpus: int | None) -> Plan | None:
    """Write ``run_dir``/run_plan.md and run_plan.json as a run starts; stop the run when
    the disk will not hold it or the target will not fit its GPUs (unless
    ``plan.stop_if_short`` is false). None,
    said on stderr, while the ``target`` folder does not exist yet (the demo
    builds its own) or the plan cannot be made (a stand-in target's config)."""
    if not (target / "config.json").exists():
        print("plan: written once the target exists (the next run)", file=sys.stderr)
        return None
    try:
        plan = build_plan(config, run_dir, load_rates(config["plan"]["rates"], config["device"]), local_gpus=local_gpus)
    except (OSError, ValueError, KeyError) as error:  # an estimate never stops a run
        print(f"plan: not written ({type(error).__name__}: {error})", file=sys.stderr)
        return None
    markdown = run_dir / run_folder.RUN_PLAN_TEXT
    write_text(markdown, render_markdown(plan))
    write_text(run_dir / run_folder.RUN_PLAN, render_json(plan))
    print(f"plan: {markdown} ({len(plan.warnings)} warning(s))", file=sys.stderr)
    if plan.exit_code == WILL_NOT_FIT and config["plan"]["stop_if_short"]:
        reasons = [warning for warning in plan.warnings if warning.startswith(UNFIT)]  # disk, GPU memory
        raise SystemExit(f"The plan says this run {'; it '.join(reasons)}. No job was started; "
                         f"set plan.stop_if_short: false to warn only. The whole plan: {markdown}.")  # fmt: skip
    return plan


def render_markdown(plan: Plan) -> str:
    rows = [
        f"| {s.name} | {s.jobs} | {s.gpus_per_job} | {s.model_loads} | {fmt_bytes(s.bytes_written)} | "
        f"{fmt_duration(s.seconds)} | {s.gpu_hours:,.2f} | "
        + ("" if s.reused is None else f"{s.reused:,} / {s.computed:,}")
        + " |"
        for s in plan.stages
    ]
    lines = [
        f"# Plan of run `{plan.run}`",
        "",
        f"{plan.tokens['samples']:,} samples, {plan.tokens['tokens']:,} tokens ({plan.tokens['source']}); "
        f"rates: {plan.rates}.",
        *(f"- {note}" for note in plan.rate_notes),
        "",
        "| stage | jobs | GPUs per job | model loads | bytes written | wall time | GPU-hours | kept / computed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        f"| **total** | {sum(s.jobs for s in plan.stages)} | | {sum(s.model_loads for s in plan.stages)} | "
        f"{fmt_bytes(plan.total_bytes)} | {fmt_duration(plan.total_seconds)} | {plan.total_gpu_hours:,.2f} | |",
        "",
        "kept / computed: conversations answered by an earlier run / asked now (generate_server); samples whose "
        "hidden-state files are kept / extracted now (extract_server).",
        f"Disk: up to {fmt_bytes(plan.peak_bytes)} at the peak (training replaces its checkpoint), "
        f"{fmt_bytes(plan.free_bytes)} free ({plan.free_source}): "
        + ("fits." if plan.exit_code == FITS else "**will not fit**."),
        "",
        *gpu_fit_lines(plan.gpu_fit),
        "Wall times add up stage by stage; stages that run side by side finish sooner.",
    ]
    if plan.warnings:
        lines += ["", "## Warnings", "", *(f"- {warning}" for warning in plan.warnings)]
    return "\n".join(lines) + "\n"


def gpu_fit_lines(fit: GpuFit | None) -> list[str]:
    if fit is None:
        return []
    return [f"GPU memory per server GPU: {fmt_bytes(fit.needed_bytes)} needed (weights {fmt_bytes(fit.weight_bytes)}, "
            f"KV cache of one sequence {fmt_bytes(fit.kv_cache_bytes)}, runtime {fmt_bytes(fit.reserve_bytes)}, an "
            f"estimate), vLLM takes {fmt_bytes(fit.usable_bytes)} of {fmt_bytes(fit.gpu_bytes)} ({fit.source}): "
            + ("fits." if fit.fits else "**will not fit**."), ""]  # fmt: skip


def render_json(plan: Plan) -> str:
    return json.dumps(asdict(plan), indent=2) + "\n"


def main(argv: list[str] | None = None, prog: str = "draftflow plan") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="What a run will cost per stage (jobs, GPUs, model loads, bytes, time, GPU-hours) before it starts.",
        epilog="exit codes: 0 fits; 3 will not fit; 1 a file it needs is missing; 2 bad arguments.",
    )
    parser.add_argument("--configfile", type=Path, nargs="+", action="extend", required=True, metavar="FILE",
                        help="the run's config file(s), as Snakemake takes them (later files over earlier ones)")  # fmt: skip
    parser.add_argument("--directory", type=Path, default=Path.cwd(), help="the workflow's working directory (default: here)")
    parser.add_argument("--rates", type=Path, help="an earlier run's results/<run>, or a rates YAML (fields of draftflow.plan.Rates)")
    parser.add_argument("--free-bytes", type=size_argument, metavar="SIZE",
                        help="free space to plan against (default: measured; e.g. 800G, 1.5TB, 2TiB)")  # fmt: skip
    parser.add_argument("--gpus", type=int, help="GPUs of one node (default: this machine's; pass the nodes' count on a login node)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    try:
        config = load_config(*args.configfile)
        rates = load_rates(args.rates, config["device"])
        gpus = local_gpu_count() if args.gpus is None else args.gpus
        plan = build_plan(config, args.directory / run_folder.result(config["run"], ""), rates, args.free_bytes, gpus)
    except (FileNotFoundError, ValueError, KeyError) as error:
        print(f"plan: {error}", file=sys.stderr)
        return 1
    print(render_json(plan) if args.json else render_markdown(plan), end="")
    return plan.exit_code


if __name__ == "__main__":
    sys.exit(main())
