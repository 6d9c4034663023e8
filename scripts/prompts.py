from pathlib import Path

from draftflow.io import write_json, write_jsonl
from draftflow.prompts import select_prompts
from draftflow.rule_log import logged

with logged(snakemake.log[0]):
    rows, stats = select_prompts(
        [Path(p) for p in snakemake.input.prompt_files],
        num_samples=snakemake.params.num_samples,
        seed=snakemake.params.seed,
        on_bad_row=snakemake.params.on_bad_row,
    )
    write_jsonl(snakemake.output.conversations, rows)
    write_json(snakemake.output.stats, stats.as_dict())
    print(stats.as_dict())
