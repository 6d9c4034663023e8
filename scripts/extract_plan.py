from pathlib import Path

from draftflow.extract.journal_key import extraction_settings
from draftflow.extract.shards import (
    check_free_space,
    load_samples,
    plan_extraction,
    remove_stale_shards,
    reusable_samples,
)
from draftflow.io import write_json
from draftflow.layers import resolve_layer_ids
from draftflow.rule_log import logged
from draftflow.target_model import read_target_model

params = snakemake.params
with logged(snakemake.log[0]):
    target = read_target_model(snakemake.input.target)
    output_dir = Path(params.output_dir)
    removed = remove_stale_shards(output_dir, params.shards, params.servers)
    if removed:
        print(f"{params.shards} shards on {params.servers} server jobs now: removed stale {removed}")
    settings = extraction_settings(
        params.backend,
        resolve_layer_ids(params.layer_ids, target.num_layers),
        params.dtype,
        params.storage,
        Path(snakemake.input.target),
        params.server_args,
    )
    samples = load_samples(Path(snakemake.input.dataset))
    reused = reusable_samples(output_dir, samples, params.shards, settings)
    plan = plan_extraction(samples, params.shards, params.servers, settings, target.hidden_size, reused)
    plan["disk"] = check_free_space(output_dir, plan["bytes_to_write"], params.disk_margin)
    write_json(snakemake.output.plan, plan)
    print(
        f"{plan['samples']} samples, {plan['tokens']} tokens, {plan['bytes'] / 1e6:.1f} MB in {params.shards} shards "
        f"on {params.servers} server jobs: {plan['reused']} samples' files kept, {plan['samples'] - plan['reused']} to extract"
    )
