from pathlib import Path

from draftflow.io import read_json
from draftflow.prepare import prepare
from draftflow.rule_log import logged

with logged(snakemake.log[0]):
    stats = prepare(
        Path(snakemake.input.samples),
        Path(snakemake.input.generation_stats),
        snakemake.input.target,
        chat_template=snakemake.params.chat_template,
        max_length=snakemake.params.max_seq_length,
        minimum_valid_tokens=snakemake.params.minimum_valid_tokens,
        on_too_long=snakemake.params.on_too_long,
        dataset_output=Path(snakemake.output.dataset),
        token_freq_output=Path(snakemake.output.token_freq),
        stats_output=Path(snakemake.output.stats),
        evaluation_sets=read_json(snakemake.input.evaluation_sets),
    )
    print(stats)
