from pathlib import Path

from datasets import load_from_disk

from draftflow.io import write_json
from draftflow.gpus import claim_gpus
from draftflow.rule_log import logged
from draftflow.serve_check import serve_check

params = snakemake.params
with logged(snakemake.log.log), claim_gpus(snakemake.resources.gpu):
    heldout = load_from_disk(snakemake.input.heldout).with_format(None)
    prompts = [ids[: mask.index(1)] for ids, mask in zip(heldout["input_ids"], heldout["loss_mask"], strict=True)]
    result = serve_check(
        snakemake.input.target,
        Path(snakemake.input.drafter),
        prompts[: params.max_requests],
        params.draft_tokens,
        params.max_tokens,
        params.server,
        Path(snakemake.log.server),
    )
    write_json(snakemake.output.served, result)
    print(result)
