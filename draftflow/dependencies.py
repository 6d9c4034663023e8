"""What each stage's work depends on: the one owner of rerun decisions.

Each stage of ``run_folder.STAGES`` reads config keys, a part of the target
(``fingerprint``: its model, its tokenizer and chat template, or both) and the
outputs of the stages before it; its rule's code is its ``code`` param
(``provenance.code_version``). From this the workflow derives:

- every rule's ``depends`` param (``stage_depends``): the values of what the
  stage reads, so Snakemake reruns it when one changes, the target's weights
  overwritten in place included;
- the answer store's key (``generation_key``): what makes the target answer
  otherwise;
- the extraction journal's key (``extraction_settings``): what makes a
  hidden-state file's bytes, the extraction code and the packages that run it
  included;
- the README's rebuild table (``draftflow.rebuild_table``, which keeps the rows
  apart: editing them reruns no job whose script imports this module).

Standard library only: Snakemake's parse and the plan read it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from draftflow import chat_template
from draftflow.extract.layout import ExtractionSettings
from draftflow.fingerprint import model_identity, target_fingerprint, tokenizer_identity
from draftflow.provenance import PACKAGE_ROOT, code_version
from draftflow.target_model import TargetModel
from draftflow.vllm_registry import installed_version, vllm_builds
from draftflow.vllm_support import generation_server_flags, target_server_flags


@dataclass(frozen=True)
class Reads:
    config: tuple[str, ...]  # dotted keys its rule's params take; a section stands for each of its keys
    after: tuple[str, ...] = ()  # the stages whose outputs it reads
    target: str | None = None  # "model", "tokenizer" or "target" (both, and generation_config.json)
    extraction: bool = False  # it makes or plans hidden states: the extraction's code and packages count


# What a vLLM server of the target is started with (vllm_support.target_server_flags).
SERVER = ("vllm", "target.dtype", "target.trust_remote_code", "seed", "device")
EXTRACTION = ("extract.backend", "extract.storage", "target.dtype")
EXTRACTION_JOB = (*SERVER, *EXTRACTION, "extract.token_budget", "extract.compile", "extract.concurrency",
                  "extract.max_retries")  # fmt: skip

STAGES = {
    "prompts": Reads(("data", "seed")),
    "generate": Reads((*SERVER, "generate"), after=("prompts",), target="target"),
    "prepare": Reads(("prepare", "vllm.extra_args"), after=("generate",), target="tokenizer"),
    "vocab_map": Reads(("vocab",), after=("prepare",), target="model"),
    "extract_plan": Reads((*SERVER, *EXTRACTION, "extract.layer_ids", "extract.shards", "extract.servers",
                           "extract.disk_margin"), after=("prepare",), target="model", extraction=True),
    "fidelity_reference": Reads((*EXTRACTION_JOB, "extract.fidelity", "extract.fidelity_device_memory_gb",
                                 "extract.fidelity_samples", "extract.fidelity_min_greedy_agreement",
                                 "generate.temperature"),
                                after=("extract_plan", "prepare"), target="model"),
    "extract_server": Reads((*EXTRACTION_JOB, "extract.write_threads"), after=("extract_plan", "prepare"),
                            target="model", extraction=True),
    "extract": Reads((), after=("extract_server",)),
    "fidelity": Reads((*EXTRACTION_JOB, "extract.fidelity_tolerance"),
                      after=("fidelity_reference", "extract_plan", "prepare", "extract"), target="model",
                      extraction=True),
    "drafter_init": Reads(("train.num_layers", "train.attention", "seed"), after=("extract_plan", "vocab_map"),
                          target="model"),
    "train_views": Reads(("train.heldout_fraction", "seed"), after=("prepare", "extract")),
    "train": Reads(("train", "seed", "device"), after=("drafter_init", "train_views")),
    "evaluate": Reads(("evaluate.draft_tokens", "evaluate.min_acceptance_length", "evaluate.serve_check_requests",
                       "generate.max_tokens", "train.attention"),
                      after=("train_views", "extract_plan", "train", "drafter_init"), target="model"),
    "serve_check": Reads((*SERVER, "evaluate.draft_tokens", "evaluate.serve_check_requests",
                          "evaluate.max_served_shortfall", "generate.max_tokens"),
                         after=("evaluate", "train_views", "train", "drafter_init"), target="model"),
    "report": Reads(("report", "evaluate.serve_check"), after=("prompts", "generate", "prepare", "vocab_map", "extract_plan",
                                        "fidelity_reference", "extract_server", "extract", "fidelity",
                                        "drafter_init", "train_views", "train", "evaluate", "serve_check")),
    # it records the whole config, and a hash of every stage's inputs
    "provenance": Reads((), after=("prompts", "generate", "prepare", "vocab_map", "extract_plan",
                                   "fidelity_reference", "extract_server", "extract", "drafter_init",
                                   "train_views", "train", "evaluate", "report")),
}  # fmt: skip

# Keys that change no byte of the data any stage makes (answers, samples, hidden states,
# the drafter, the evaluation): a rule whose params take one (a server's port, a job's
# threads) reruns when it changes, and reuses every answer and file it finds; records of
# how the work ran (logs, plan.json, provenance.json) may differ. Keys no rule takes are
# here too.
NO_EFFECT = {
    "run": "names the run's folders; another run is another folder",
    "target.path": "the target counts by what it holds (draftflow.fingerprint), not where it lies: a copied or moved target is the same",
    "vllm.host": "where the server listens",
    "vllm.port": "where the server listens",
    "vllm.health_timeout_s": "how long a server start may take",
    "vllm.cpu_kvcache_space_gib": "the KV cache's room: how many requests run at once, not what they compute",
    "vllm.cpu_single_process": "whether vLLM's engine runs in its own process",
    "vllm.data_parallel_size": "replicas of one model answer alike; it spreads the requests",
    "vllm.max_model_len": "the room for a prompt and its answer: an answer that fits is the same (one that does not is an error, asked again)",
    "generate.endpoint": "who serves the target; its answers are keyed as the config describes that server",
    "generate.api_key_env": "the credential that opens the endpoint",
    "generate.concurrency": "requests in flight at once",
    "generate.max_retries": "how often a failed request is asked again",
    "generate.max_error_fraction": "a gate: the rule fails, the answers are kept",
    "generate.max_degenerate_fraction": "a gate: the rule fails, the answers are kept",
    "extract.write_threads": "threads that write finished files",
    "extract.concurrency": "requests in flight at once",
    "extract.max_retries": "how often a failed request is asked again",
    "extract.compile": "torch.compile runs the same layers",
    "extract.token_budget": "samples per forward pass; each sample's states are its own",
    "extract.fidelity_device_memory_gb": "where the reference runs (extract.fidelity: auto), not what it computes",
    "extract.disk_margin": "a gate: extract_plan refuses to start without room",
    "extract.servers": "how many jobs share the shards; a shard's files do not depend on its job",
    "train.checkpoint_every_steps": "how often training saves where a rerun resumes",
    "train.gpus": "GPUs of the training job",
    "plan.rates": "the plan's estimate only",
    "plan.stop_if_short": "a gate: the run does not start without room",
}  # fmt: skip

# Server flags that change no answer; ``--chat-template`` counts by the text it gives.
UNKEYED_SERVER_FLAGS = {
    "--data-parallel-size": NO_EFFECT["vllm.data_parallel_size"],
    "--max-model-len": NO_EFFECT["vllm.max_model_len"],
    "--enforce-eager": "CUDA graphs replay the same kernels",
}


def leaves(config: dict, key: str) -> dict:
    """``key``'s value, or each of its section's leaves, by dotted key."""
    value = config
    for part in key.split("."):
        value = value[part]
    if not isinstance(value, dict):
        return {key: value}
    return {leaf: v for name in value for leaf, v in leaves(config, f"{key}.{name}").items()}


def stage_config(config: dict, stage: str) -> dict:
    """The values of the config keys ``stage`` reads that change its outputs, by key."""
    values = {leaf: v for key in STAGES[stage].config for leaf, v in leaves(config, key).items()}
    return {key: value for key, value in sorted(values.items()) if key not in NO_EFFECT}


def target_identities(target: Path | None) -> dict[str, str]:
    """The identities of ``target`` a stage may read (Reads.target); None: the workflow
    builds the target, and Snakemake's mtimes follow the rule that builds it."""
    if target is None:
        return dict.fromkeys(("model", "tokenizer", "target"), "built by the workflow")
    return {"model": model_identity(target), "tokenizer": tokenizer_identity(target), "target": target_fingerprint(target)}


def stage_depends(config: dict, stage: str, identities: dict[str, str]) -> dict:
    """A rule's ``depends`` param: the config values, the target's identity (from
    ``target_identities``) and for the extraction its code and packages."""
    reads = STAGES[stage]
    depends = {"config": stage_config(config, stage)}
    if reads.target:
        depends["target"] = identities[reads.target]
    if reads.extraction:
        depends["extraction"] = extraction_code(config["extract"]["backend"])
    return depends


# -- generation -----------------------------------------------------------------------


def keyed_server_flags(server_args: list[str]) -> list[str]:
    """A generation server's flags as they shape answers: UNKEYED_SERVER_FLAGS out, the
    ``--chat-template`` value replaced by the sha256 of the text it gives."""
    keyed, skip = [], False
    for position, arg in enumerate(server_args):
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        takes_value = "=" not in arg and position + 1 < len(server_args) and not server_args[position + 1].startswith("--")
        if name in UNKEYED_SERVER_FLAGS:
            skip = takes_value
            continue
        if name == chat_template.FLAG:
            keyed.append(f"{name}=sha256:{chat_template.digest(chat_template.flag_text(chat_template.flag_value(server_args)))}")
            skip = takes_value
            continue
        keyed.append(arg)
    return keyed


def generation_key(target: Path, server_args: list[str], max_tokens: int, temperature: float, seed: int) -> str:
    """The answer store's key: the target (model, tokenizer, chat template, sampling
    defaults), the server's flags as they shape answers, and the sampling settings.
    No path: a copied or moved target or run folder finds its answers."""
    shaping = [target_fingerprint(target), keyed_server_flags(server_args), max_tokens, temperature, seed]
    return hashlib.sha256(json.dumps(shaping).encode()).hexdigest()[:16]


# -- extraction -----------------------------------------------------------------------

EXTRACTION_PACKAGES = {"vllm": ("torch", "transformers"), "transformers": ("torch", "transformers")}


def extraction_code(backend: str) -> dict:
    """The code and package builds that make a hidden-state file's bytes: the backend's
    modules (the connector vLLM's server loads included) and the shard writer's."""
    modules = [PACKAGE_ROOT / "extract" / f"{backend}_backend.py", PACKAGE_ROOT / "extract" / "shards.py"]
    builds = {name: installed_version(name) or "not installed" for name in EXTRACTION_PACKAGES[backend]}
    if backend == "vllm":
        builds["vllm"] = ", ".join(vllm_builds()) or "not installed"
    return {"code": "+".join(code_version(module) for module in modules), "builds": builds}


def extraction_settings(
    backend: str, layer_ids: list[int], dtype: str, storage: str, target: Path, server_args: list[str]
) -> ExtractionSettings:
    """What makes a shard's files (the journal's settings key is its hash): the model,
    the layers, dtype and storage, the extraction code and packages, and for the vllm
    backend its server's flags as they shape answers (the chat template aside: the
    server is given token ids)."""
    code = extraction_code(backend)
    flags = [flag for flag in keyed_server_flags(server_args) if not flag.startswith(chat_template.FLAG)]
    return ExtractionSettings(backend, tuple(layer_ids), dtype, model_identity(target), storage, code["code"],
                              tuple(sorted(code["builds"].items())), tuple(flags) if backend == "vllm" else ())  # fmt: skip


def run_generation_key(config: dict, target: TargetModel) -> str:
    """The key a run of ``config`` stores its answers under, as its generate job computes it."""
    generate = config["generate"]
    flags = generation_server_flags(config, target)
    return generation_key(target.folder, flags, generate["max_tokens"], generate["temperature"], config["seed"])


def run_extraction_settings(config: dict, target: TargetModel, layer_ids: list[int]) -> ExtractionSettings:
    """The settings a run of ``config`` extracts under, as its extract_plan job makes them."""
    extract = config["extract"]
    flags = target_server_flags(config, target)
    return extraction_settings(extract["backend"], layer_ids, config["target"]["dtype"], extract["storage"], target.folder, flags)


def downstream(stages: set[str]) -> set[str]:
    """``stages`` and every stage that reads their outputs, directly or not."""
    found = set(stages)
    while more := {name for name, reads in STAGES.items() if set(reads.after) & found} - found:
        found |= more
    return found


def stages_reading(change: str) -> set[str]:
    """The stages that read ``change``: a config key (``data.num_samples``), a part of
    the target (``target:model``, ``target:tokenizer``) or the extraction's code and
    packages (``extraction``)."""
    if change.startswith("target:"):
        part = change.split(":", 1)[1]
        return {name for name, reads in STAGES.items() if reads.target in (part, "target")}
    if change == "extraction":
        return {name for name, reads in STAGES.items() if reads.extraction}
    return {
        name for name, reads in STAGES.items()
        if any(change == key or change.startswith(f"{key}.") for key in reads.config)
    }  # fmt: skip


def reruns(changes: tuple[str, ...]) -> list[str]:
    """The stages an edit reruns, in the workflow's order."""
    found = downstream(set().union(*(stages_reading(change) for change in changes)))
    return [name for name in STAGES if name in found]
