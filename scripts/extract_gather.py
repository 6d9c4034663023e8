from pathlib import Path

from draftflow.io import read_json, write_json, write_text
from draftflow.progress import Options, check, render_json, render_table
from draftflow.rule_log import logged

with logged(snakemake.log[0]):
    manifests = [read_json(path) for path in snakemake.input.manifests]
    summary = {
        key: manifests[0][key]
        for key in ("backend", "dtype", "layer_ids", "hidden_size", "target", "target_fingerprint", "num_shards")
    }
    for key in ("samples", "tokens", "bytes"):
        summary[key] = sum(m[key] for m in manifests)
    summary["shards"] = [f"shard-{m['shard']}.json" for m in manifests]
    write_json(snakemake.output.summary, summary)
    print(summary)
    final_progress = check(Path(snakemake.output.summary).parent, Options(check_pids=False))
    write_text(snakemake.output.progress, render_table(final_progress))
    write_text(snakemake.output.progress_json, render_json(final_progress))
