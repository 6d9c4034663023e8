from pathlib import Path

from draftflow.extract.layout import hidden_state_files
from draftflow.extract.shards import check_free_space, load_samples, plan_extraction, remove_stale_shards
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
    plan = plan_extraction(
        load_samples(Path(snakemake.input.dataset)),
        params.shards,
        params.servers,
        resolve_layer_ids(params.layer_ids, target.num_layers),
        target.hidden_size,
        params.dtype,
        params.storage,
    )
    on_disk = sum(path.stat().st_size for path in hidden_state_files(output_dir))
    plan["disk"] = check_free_space(output_dir, plan["bytes"] - on_disk, params.disk_margin)
    write_json(snakemake.output.plan, plan)
    print(f"{plan['samples']} samples, {plan['tokens']} tokens, {plan['bytes'] / 1e6:.1f} MB in {params.shards} shards on {params.servers} server jobs")
