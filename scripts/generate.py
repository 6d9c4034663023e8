from functools import partial
from pathlib import Path

from draftflow.answers import answer_store, generation_key
from draftflow.generate import (
    GenerationSettings,
    ask_unanswered,
    finish,
    target_endpoint,
)
from draftflow.gpus import claim_gpus
from draftflow.io import read_json
from draftflow.rule_log import logged
from draftflow.vllm_server import vllm_server

params = snakemake.params
with logged(snakemake.log.log), claim_gpus(snakemake.resources.gpu):
    settings = GenerationSettings(**params.settings)
    conversations = Path(snakemake.input.conversations)
    key = generation_key(Path(snakemake.input.target), params.server["args"], settings.max_tokens, settings.temperature, settings.seed)
    store = answer_store(Path(params.work_dir), key)
    server_log = None if params.endpoint else Path(snakemake.log.server)
    start_server = partial(vllm_server, snakemake.input.target, log_path=server_log, **params.server)
    endpoint = partial(target_endpoint, params.endpoint, params.api_key_env, start_server)
    seconds, asked_now = ask_unanswered(conversations, store, settings, endpoint, server_log, snakemake.input.target)
    finish(
        store,
        conversations,
        snakemake.input.target,
        settings,
        seconds,
        asked_now,
        endpoint=params.endpoint or "local vLLM server",
        server_args=None if params.endpoint else params.server["args"],
        output=Path(snakemake.output.samples),
        errors_output=Path(snakemake.output.errors),
        stats_output=Path(snakemake.output.stats),
        evaluation_ids={i for listed in read_json(snakemake.input.evaluation_sets).values() for i in listed["samples"]},
    )
