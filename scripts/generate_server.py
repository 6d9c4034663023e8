from functools import partial
from pathlib import Path

from draftflow.answers import generation_key
from draftflow.generate import GenerationSettings, answer_share, target_endpoint
from draftflow.gpus import claim_gpus
from draftflow.rule_log import logged
from draftflow.vllm_server import vllm_server

params = snakemake.params
with logged(snakemake.log.log), claim_gpus(snakemake.resources.gpu):
    settings = GenerationSettings(**params.settings)
    key = generation_key(Path(snakemake.input.target), params.server["args"], params.settings)
    server_log = None if params.endpoint else Path(snakemake.log.server)
    start_server = partial(vllm_server, snakemake.input.target, log_path=server_log, **params.server)
    answer_share(
        Path(snakemake.input.conversations),
        Path(params.work_dir),
        key,
        int(snakemake.wildcards.server),
        params.servers,
        settings,
        endpoint=partial(target_endpoint, params.endpoint, params.api_key_env, start_server),
        server_log=server_log,
        tokenizer_dir=snakemake.input.target,
        output=Path(snakemake.output.answered),
        server_args=None if params.endpoint else params.server["args"],
    )
