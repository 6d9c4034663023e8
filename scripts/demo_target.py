from pathlib import Path

from demo.target import build_demo_target, write_demo_prompts
from draftflow.io import atomic_path
from draftflow.rule_log import logged

with logged(snakemake.log[0]):
    with atomic_path(snakemake.output.model) as model_dir:
        print(build_demo_target(model_dir, seed=snakemake.params.seed, threads=snakemake.threads))
    write_demo_prompts(
        Path(snakemake.output.prompts),
        count=snakemake.params.prompt_count,
        seed=snakemake.params.seed,
    )
