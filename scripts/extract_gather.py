from pathlib import Path

from draftflow.extract.layout import shard_manifest_path
from draftflow.io import read_json, write_json, write_text
from draftflow.progress import Options, check, render_json, render_table
from draftflow.rule_log import logged

with logged(snakemake.log[0]):
    output_dir = Path(snakemake.output.summary).parent
    shards = sorted(shard for path in snakemake.input.servers for shard in read_json(path)["shards"])
    manifests = [read_json(shard_manifest_path(output_dir, shard)) for shard in shards]
    summary = {
        key: manifests[0][key]
        for key in ("backend", "dtype", "storage", "layer_ids", "hidden_size", "target", "model_identity", "num_shards")
    }
    for key in ("samples", "tokens", "bytes"):
        summary[key] = sum(m[key] for m in manifests)
    summary["shards"] = [shard_manifest_path(output_dir, shard).name for shard in shards]
    write_json(snakemake.output.summary, summary)
    print(summary)
    final_progress = check(output_dir, Options(check_pids=False))
    write_text(snakemake.output.progress, render_table(final_progress))
    write_text(snakemake.output.progress_json, render_json(final_progress))
