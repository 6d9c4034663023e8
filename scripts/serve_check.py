from pathlib import Path

from datasets import load_from_disk

from draftflow.evaluate import answer_start
from draftflow.gpus import claim_gpus
from draftflow.io import read_json, write_json
from draftflow.rule_log import logged
from draftflow.serve_check import decide, plot_served_acceptance, serve_check, shortfall_problem

params = snakemake.params
with logged(snakemake.log.log), claim_gpus(snakemake.resources.gpu):
    heldout = load_from_disk(snakemake.input.heldout).with_format(None)
    prompts = [ids[: answer_start(mask)] for ids, mask in zip(heldout["input_ids"], heldout["loss_mask"], strict=True)]
    result = serve_check(
        snakemake.input.target,
        Path(snakemake.input.drafter),
        Path(snakemake.input.init),
        prompts[: params.max_requests],
        params.draft_tokens,
        params.max_tokens,
        params.server,
        Path(snakemake.log.server),
    )
    offline = read_json(snakemake.input.evaluation)["trained"]
    write_json(snakemake.output.served, result)
    plot_served_acceptance(offline, result, Path(snakemake.output.plot))
    print(result)
    shortfall = shortfall_problem(offline["decoding_replay"], result, params.max_served_shortfall)
    decide(result, [shortfall] if shortfall else [])
