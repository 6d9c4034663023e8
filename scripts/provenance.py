from pathlib import Path

from draftflow.io import write_json
from draftflow.provenance import provenance
from draftflow.rule_log import logged

with logged(snakemake.log[0]):
    record = provenance(
        snakemake.config,
        Path(snakemake.input.target),
        snakemake.params.target_hub,
        snakemake.params.stage_inputs,
    )
    write_json(snakemake.output.provenance, record)
