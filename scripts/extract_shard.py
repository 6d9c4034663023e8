from functools import partial
from pathlib import Path

from draftflow.extract_backends import open_extractor
from draftflow.extraction import ExtractionSettings, load_samples, run_shard, shard_manifest, shard_samples
from draftflow.fingerprint import target_fingerprint
from draftflow.io import read_json, write_json
from draftflow.gpus import claim_gpus
from draftflow.rule_log import logged

params = snakemake.params
shard = int(snakemake.wildcards.shard)
with logged(snakemake.log.log), claim_gpus(snakemake.resources.gpu):
    plan = read_json(snakemake.input.plan)
    target = snakemake.input.target
    settings = ExtractionSettings(
        backend=params.backend,
        layer_ids=tuple(plan["layer_ids"]),
        dtype=plan["dtype"],
        target_fingerprint=target_fingerprint(target),
    )
    samples = shard_samples(load_samples(Path(snakemake.input.dataset)), shard, plan["num_shards"])
    records = run_shard(
        samples,
        shard,
        Path(params.output_dir) / f"shard-{shard}",
        Path(params.output_dir) / f"shard-{shard}.heartbeat.json",
        settings,
        partial(open_extractor, params.backend, target, plan["layer_ids"], params.backend_options, Path(snakemake.log.server)),
        writers=params.write_threads,
    )
    manifest = shard_manifest(shard, plan["num_shards"], records, settings, plan["hidden_size"], target)
    write_json(snakemake.output.manifest, manifest)
    print(f"shard {shard}: {manifest['samples']} samples, {manifest['tokens']} tokens, {manifest['bytes'] / 1e6:.1f} MB")
