from pathlib import Path

from draftflow.io import read_json
from draftflow.model_card import write_release
from draftflow.rule_log import logged

with logged(snakemake.log[0]):
    inputs = {name: read_json(path) for name, path in snakemake.input.items() if name != "drafter" and path}
    write_release(Path(snakemake.input.drafter), inputs, snakemake.params.settings, Path(snakemake.output.drafter))
    print(f"{snakemake.output.drafter}: the drafter's files and its model card")
