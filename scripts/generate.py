from functools import partial
from pathlib import Path

from draftflow.generate import GenerationSettings, finish, regenerate, target_endpoint, timed, work_file
from draftflow.gpus import claim_gpus
from draftflow.rule_log import logged
from draftflow.vllm_server import vllm_server

params = snakemake.params
with logged(snakemake.log.log), claim_gpus(snakemake.resources.gpu):
    settings = GenerationSettings(**params.settings)
    conversations = Path(snakemake.input.conversations)
    partial_output = work_file(Path(params.work_dir), conversations, snakemake.input.target, settings)
    server_log = None if params.endpoint else Path(snakemake.log.server)
    start_server = partial(vllm_server, snakemake.input.target, log_path=server_log, **params.server)
    with target_endpoint(params.endpoint, params.api_key_env, start_server) as url:
        seconds = timed(regenerate, url, conversations, partial_output, settings, server_log)
    finish(
        partial_output,
        conversations,
        snakemake.input.target,
        settings,
        seconds,
        endpoint=params.endpoint or "local vLLM server",
        output=Path(snakemake.output.samples),
        errors_output=Path(snakemake.output.errors),
        stats_output=Path(snakemake.output.stats),
    )
