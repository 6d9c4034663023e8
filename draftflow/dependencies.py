"""What each stage's work depends on: the one owner of rerun decisions.

Each stage of ``run_folder.STAGES`` reads config keys, a part of the target
(``fingerprint``: its model, its tokenizer and chat template, or both) and the
outputs of the stages before it; its rule's code is its ``code`` param
(``provenance.code_version``). From this the workflow derives:

- every rule's ``depends`` param (``stage_depends``): the values of what the
  stage reads, so Snakemake reruns it when one changes, the target's weights
  overwritten in place included;
- the answer store's key (``answers.generation_key``): what makes the target
  answer otherwise;
- the extraction journal's key (``extract.journal_key.extraction_settings``):
  what makes a hidden-state file's bytes, the extraction code and the packages
  that run it included;
- the rebuild table of docs/rebuilds.md (``draftflow.rebuild_table``).

The two keys are built beside the formats they key (the server's part in
``server_flags``), so that the generate and extract_plan jobs' code versions
cover their own stage's modules, not this one; the plan computes them as those
jobs do (``run_generation_key``, ``run_extraction_settings``).

Standard library only: Snakemake's parse and the plan read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from draftflow.answers import generation_key
from draftflow.extract.journal_key import extraction_code, extraction_settings
from draftflow.extract.layout import ExtractionSettings
from draftflow.fingerprint import model_identity, target_fingerprint, tokenizer_identity
from draftflow.server_flags import UNKEYED_SERVER_FLAGS
from draftflow.target_model import TargetModel
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
    "prompts": Reads(("data", "evaluate.datasets", "seed")),
    "generate_server": Reads((*SERVER, "generate"), after=("prompts",), target="target"),
    "generate": Reads((*SERVER, "generate"), after=("prompts", "generate_server"), target="target"),
    "prepare": Reads(("prepare", "vllm.extra_args"), after=("prompts", "generate"), target="tokenizer"),
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
    "train": Reads(("train", "seed", "device", "evaluate.draft_tokens", "generate.max_tokens"),
                   after=("drafter_init", "train_views", "generate"), target="model"),
    "evaluate": Reads(("evaluate.draft_tokens", "evaluate.draft_token_sweep", "evaluate.temperatures", "evaluate.min_acceptance_length",
                       "evaluate.gate_temperature", "evaluate.serve_check_requests", "generate.max_tokens", "generate.temperature",
                       "train.attention", "device"),
                      after=("train_views", "extract_plan", "generate", "train", "drafter_init"), target="model"),
    "serve_check": Reads((*SERVER, "evaluate.draft_tokens", "evaluate.draft_token_sweep", "evaluate.temperatures",
                          "evaluate.serve_check_requests", "evaluate.max_served_shortfall", "generate.max_tokens",
                          "generate.reasoning_parser"),
                         after=("evaluate", "train_views", "generate", "train", "drafter_init"), target="model"),
    "pilot": Reads(("pilot.fractions", "pilot.predict_for", "pilot.target_acceptance_length", "pilot.bootstrap_draws", "train",
                    "seed", "device", "evaluate.draft_tokens", "evaluate.serve_check_requests", "generate.max_tokens",
                    "data.num_samples"), after=("drafter_init", "prepare", "extract", "train_views", "train", "generate"),
                   target="model"),
    "report": Reads(("report", "evaluate.serve_check", "pilot.enabled"), after=("prompts", "generate_server", "generate", "prepare", "vocab_map", "extract_plan",
                                        "fidelity_reference", "extract_server", "extract", "fidelity",
                                        "drafter_init", "train_views", "train", "evaluate", "serve_check", "pilot")),
    # it records the whole config, and a hash of every stage's inputs
    "provenance": Reads((), after=("prompts", "generate_server", "generate", "prepare", "vocab_map", "extract_plan",
                                   "fidelity_reference", "extract_server", "extract", "drafter_init",
                                   "train_views", "train", "evaluate", "report")),
    "model_card": Reads((*SERVER, "evaluate.draft_tokens", "evaluate.serve_check", "generate.max_tokens", "generate.reasoning_parser"),
                        after=("prompts", "generate", "vocab_map", "extract_plan", "train", "evaluate", "serve_check",
                               "provenance")),
}  # fmt: skip

# Keys that change no byte of the data any stage makes (answers, samples, hidden states,
# the drafter, the evaluation): a rule whose params take one (a server's port, a job's
# threads) reruns when it changes, and reuses every answer and file it finds; records of
# how the work ran (logs, plan.json, provenance.json) may differ. Keys no rule takes are
# here too.
NO_EFFECT = {
    "run": "names the run's folders; another run is another folder",
    "target.path": "the target counts by what it holds (draftflow.fingerprint), not where it lies: "
    "a copied or moved target is the same",
    "vllm.host": "where the server listens",
    "vllm.port": "where the server listens",
    "vllm.health_timeout_s": "how long a server start may take",
    "vllm.cpu_kvcache_space_gib": "the KV cache's room: how many requests run at once, not what they compute",
    "vllm.cpu_single_process": "whether vLLM's engine runs in its own process",
    "vllm.data_parallel_size": UNKEYED_SERVER_FLAGS["--data-parallel-size"],
    "vllm.max_model_len": UNKEYED_SERVER_FLAGS["--max-model-len"],
    "generate.servers": "how many jobs share the conversations; an answer does not depend on the job that asked it",
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
    "pilot.num_samples": "draftflow pilot's run takes it as data.num_samples; no rule reads it",
    "plan.rates": "the plan's estimate only",
    "plan.stop_if_short": "a gate: the run does not start without room",
    "vllm.gpu_memory_gib": "the plan's GPU fit check: no output depends on it",
}  # fmt: skip


def leaves(config: dict, key: str) -> dict:
    """``key``'s value, or each of its section's leaves, by dotted key (an empty
    mapping, such as ``generate.chat_template_kwargs`` unset, is a leaf)."""
    value = config
    for part in key.split("."):
        value = value[part]
    if not isinstance(value, dict) or not value:
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
    return {
        "model": model_identity(target),
        "tokenizer": tokenizer_identity(target),
        "target": target_fingerprint(target),
    }


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


def run_generation_key(config: dict, target: TargetModel) -> str:
    """The key a run of ``config`` stores its answers under, as its generate job computes it."""
    return generation_key(target.folder, generation_server_flags(config, target), {**config["generate"], "seed": config["seed"]})


def run_extraction_settings(config: dict, target: TargetModel, layer_ids: list[int]) -> ExtractionSettings:
    """The settings a run of ``config`` extracts under, as its extract_plan job makes them."""
    extract = config["extract"]
    flags = target_server_flags(config, target)
    dtype = config["target"]["dtype"]
    return extraction_settings(extract["backend"], layer_ids, dtype, extract["storage"], target.folder, flags)


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
