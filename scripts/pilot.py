from pathlib import Path

import torch._dynamo

from draftflow.gpus import claim_gpus
from draftflow.pilot_training import ViewSource, run_pilot
from draftflow.rule_log import logged

# the drafters are measured as evaluate measures them: uncompiled (scripts/evaluate.py says why)
torch._dynamo.config.disable = True

params = snakemake.params
with logged(snakemake.log[0]), claim_gpus(snakemake.resources.gpu):
    run_pilot(
        Path(snakemake.input.init),
        ViewSource(Path(snakemake.input.dataset), Path(snakemake.input.hidden_states), Path(snakemake.input.split)),
        Path(snakemake.input.heldout),
        Path(snakemake.input.drafter),
        Path(snakemake.input.target),
        Path(snakemake.input.generation),
        params.settings,
        params.selection,
        params.requests,
        params.num_samples,
        params.pilot,
        Path(params.work_dir),
        Path(snakemake.output.pilot),
        Path(snakemake.output.plot),
    )
