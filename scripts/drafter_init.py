from pathlib import Path

from draftflow.io import read_json
from draftflow.rule_log import logged
from draftflow.train import DrafterShape, finalize_config, init_drafter

with logged(snakemake.log[0]):
    aux_layer_ids = read_json(snakemake.input.plan)["layer_ids"][:-1]
    output = Path(snakemake.output.drafter)
    init_drafter(
        snakemake.input.target,
        aux_layer_ids,
        Path(snakemake.input.d2t),
        Path(snakemake.input.t2d),
        DrafterShape(**snakemake.params.drafter_shape),
        output,
    )
    finalize_config(output, snakemake.input.target, aux_layer_ids)
