from functools import partial
from pathlib import Path

from draftflow.extract.backends import open_extractor
from draftflow.extract.layout import ExtractionSettings
from draftflow.extract.shards import load_samples, run_server
from draftflow.gpus import claim_gpus
from draftflow.io import read_json, write_json
from draftflow.rule_log import logged

params = snakemake.params
with logged(snakemake.log.log), claim_gpus(snakemake.resources.gpu):
    plan = read_json(snakemake.input.plan)
    target = snakemake.input.target
    settings = ExtractionSettings.from_record(plan["settings"])
    manifests = run_server(
        plan,
        int(snakemake.wildcards.server),
        load_samples(Path(snakemake.input.dataset)),
        Path(params.output_dir),
        settings,
        partial(open_extractor, params.backend, target, plan["layer_ids"], {**params.backend_options, "storage": plan["storage"]}, Path(snakemake.log.server)),
        target,
        writers=params.write_threads,
    )
    write_json(snakemake.output.manifest, {"server": int(snakemake.wildcards.server), "shards": [m["shard"] for m in manifests]})
