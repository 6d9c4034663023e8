from pathlib import Path

import torch._dynamo

from draftflow.epoch_selection import Selection, epoch_scorer
from draftflow.gpus import claim_gpus
from draftflow.io import read_json, write_json
from draftflow.rule_log import logged
from draftflow.train import TrainSettings, drafter_identity, finalize_config, train_drafter
from draftflow.training_data import check_view

# each epoch's drafter is measured as evaluate measures it: uncompiled (scripts/evaluate.py says why)
torch._dynamo.config.disable = True

with logged(snakemake.log[0]), claim_gpus(snakemake.resources.gpu):
    settings = TrainSettings(**snakemake.params.settings)
    init_dir = Path(snakemake.input.init)
    output = Path(snakemake.output.drafter)
    print(f"{check_view(Path(snakemake.input.train))} training files hold their rows' token ids")
    selection = Selection.as_served(read_json(snakemake.input.generation)["sampling"], **snakemake.params.selection)
    scorer = epoch_scorer(selection, settings.selection_samples, Path(snakemake.input.target), Path(snakemake.input.heldout),
                          settings.device, settings.attention)  # fmt: skip
    stats = train_drafter(init_dir, Path(snakemake.input.train), settings, Path(snakemake.params.work_dir), output, scorer)
    finalize_config(output, *drafter_identity(init_dir), speculative_tokens=settings.ttt_steps)
    write_json(snakemake.output.stats, stats)
