from pathlib import Path

from draftflow.answers import generation_key
from draftflow.generate import GenerationSettings, finish
from draftflow.io import read_json
from draftflow.rule_log import logged

params = snakemake.params
with logged(snakemake.log[0]):
    settings = GenerationSettings(**params.settings)
    key = generation_key(Path(snakemake.input.target), params.server_args, params.settings)
    finish(
        Path(params.work_dir),
        key,
        Path(snakemake.input.conversations),
        jobs=[read_json(path) for path in snakemake.input.servers],
        tokenizer_dir=snakemake.input.target,
        settings=settings,
        endpoint=params.endpoint or "local vLLM server",
        server_args=None if params.endpoint else params.server_args,
        output=Path(snakemake.output.samples),
        errors_output=Path(snakemake.output.errors),
        stats_output=Path(snakemake.output.stats),
        evaluation_ids={i for listed in read_json(snakemake.input.evaluation_sets).values() for i in listed["samples"]},
    )
