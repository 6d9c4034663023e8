from pathlib import Path

from draftflow.gpus import claim_gpus
from draftflow.io import write_json
from draftflow.rule_log import logged
from draftflow.train import TrainSettings, drafter_identity, finalize_config, train_drafter
from draftflow.training_data import check_view

with logged(snakemake.log[0]), claim_gpus(snakemake.resources.gpu):
    settings = TrainSettings(**snakemake.params.settings)
    init_dir = Path(snakemake.input.init)
    output = Path(snakemake.output.drafter)
    print(f"{check_view(Path(snakemake.input.train))} training files hold their rows' token ids")
    stats = train_drafter(init_dir, Path(snakemake.input.train), settings, Path(snakemake.params.work_dir), output)
    finalize_config(output, *drafter_identity(init_dir), speculative_tokens=settings.ttt_steps)
    write_json(snakemake.output.stats, stats)
