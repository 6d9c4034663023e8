from pathlib import Path

from draftflow.extraction import check_free_space, load_samples, plan_extraction, remove_stale_shards
from draftflow.io import write_json
from draftflow.layers import resolve_layer_ids
from draftflow.rule_log import logged
from draftflow.target_model import read_target_model

params = snakemake.params
with logged(snakemake.log[0]):
    target = read_target_model(snakemake.input.target)
    output_dir = Path(params.output_dir)
    removed = remove_stale_shards(output_dir, params.shards)
    if removed:
        print(f"extract.shards is now {params.shards}: removed stale {removed}")
    plan = plan_extraction(
        load_samples(Path(snakemake.input.dataset)),
        params.shards,
        resolve_layer_ids(params.layer_ids, target.num_layers),
        target.hidden_size,
        params.dtype,
    )
    on_disk = sum(p.stat().st_size for p in output_dir.glob("shard-*/hs_*.safetensors"))
    plan["disk"] = check_free_space(output_dir, plan["bytes"] - on_disk, params.disk_margin)
    write_json(snakemake.output.plan, plan)
    print(f"{plan['samples']} samples, {plan['tokens']} tokens, {plan['bytes'] / 1e6:.1f} MB in {params.shards} shards")
