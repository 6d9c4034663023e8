from pathlib import Path

from draftflow.generate import GenerationSettings, finish, regenerate, timed, work_file
from draftflow.rule_log import logged
from draftflow.vllm_server import vllm_server

params = snakemake.params
with logged(snakemake.log[0]):
    settings = GenerationSettings(**params.settings)
    conversations = Path(snakemake.input.conversations)
    partial = work_file(Path(params.work_dir), conversations, snakemake.input.target, settings)
    if params.endpoint:
        seconds = timed(regenerate, f"{params.endpoint}/v1/chat/completions", conversations, partial, settings)
    else:
        with vllm_server(snakemake.input.target, log_path=Path(snakemake.log.server), **params.server) as url:
            seconds = timed(regenerate, f"{url}/v1/chat/completions", conversations, partial, settings)
    finish(
        partial,
        snakemake.input.target,
        settings,
        seconds,
        endpoint=params.endpoint or "local vLLM server",
        output=Path(snakemake.output.samples),
        errors_output=Path(snakemake.output.errors),
        stats_output=Path(snakemake.output.stats),
    )
