from draftflow.io import write_json, write_jsonl
from draftflow.prompt_sources import PromptSource
from draftflow.prompts import select_prompts
from draftflow.rule_log import logged

params = snakemake.params
with logged(snakemake.log[0]):
    selection = select_prompts(
        [PromptSource.from_record(record) for record in params.sources],
        num_samples=params.num_samples,
        seed=params.seed,
        on_bad_row=params.on_bad_row,
        evaluation=[PromptSource.from_record(record) for record in params.evaluation_sets],
    )
    write_jsonl(snakemake.output.conversations, selection.rows)
    write_json(snakemake.output.stats, selection.stats)
    write_json(snakemake.output.evaluation_sets, selection.evaluation_sets)
    print(selection.stats)
