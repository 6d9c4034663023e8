from pathlib import Path

from draftflow.evaluate import evaluation_samples
from draftflow.gpus import claim_gpus
from draftflow.io import read_json, write_json
from draftflow.prompt_sources import HELDOUT
from draftflow.rule_log import logged
from draftflow.serve_check import decide, plot_served_acceptance, serve_check, served_prompts, shortfall_problem

params = snakemake.params
with logged(snakemake.log.log), claim_gpus(snakemake.resources.gpu):
    by_set = {**evaluation_samples(Path(snakemake.input.heldout)), **evaluation_samples(Path(snakemake.input.evaluation_sets))}
    by_set[HELDOUT] = by_set[HELDOUT][: params.max_requests]
    result = serve_check(
        snakemake.input.target,
        Path(snakemake.input.drafter),
        Path(snakemake.input.init),
        served_prompts(by_set),
        params.sweep,
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
