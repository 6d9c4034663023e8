from pathlib import Path

from draftflow.evaluate import evaluation_samples
from draftflow.gpus import claim_gpus
from draftflow.io import read_json, write_json
from draftflow.prompt_sources import HELDOUT
from draftflow.rule_log import logged
from draftflow.sampling import at_temperature, temperature_key
from draftflow.serve_check import (
    decide,
    plot_served_acceptance,
    sampled_drafting_defect,
    serve_check,
    served_prompts,
    shortfall_problem,
)

params = snakemake.params
with logged(snakemake.log.log), claim_gpus(snakemake.resources.gpu):
    by_set = {**evaluation_samples(Path(snakemake.input.heldout)), **evaluation_samples(Path(snakemake.input.evaluation_sets))}
    by_set[HELDOUT] = by_set[HELDOUT][: params.max_requests]
    generation = read_json(snakemake.input.generation)["sampling"]
    sampled = {temperature_key(t): at_temperature(generation, t)["request"] for t in sorted(set(params.temperatures) - {0})}
    # where vLLM cannot sample beside a drafter, those temperatures are measured offline only
    defect = sampled_drafting_defect(params.device)
    not_served = {key: {"not_served": defect} for key in sampled} if defect else {}
    if not_served:
        print(f"not served at temperature {', '.join(not_served)}: {defect}")
        sampled = {}
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
        sampled,
    )
    result["temperatures"] |= not_served
    evaluation = read_json(snakemake.input.evaluation)
    write_json(snakemake.output.served, result)
    plot_served_acceptance(evaluation["trained"], result, Path(snakemake.output.plot))
    print(result)
    # held to the replay where it predicts serving: at 0 and at the temperature the answers were sampled at
    shortfalls = [shortfall_problem(offline["decoding_replay"], result["temperatures"][key], params.max_served_shortfall, offline["sampling"]["temperature"])
                  for key, offline in evaluation["temperatures"].items() if offline["decoding_replay"] and "drafts" in result["temperatures"][key]]  # fmt: skip
    decide(result, [problem for problem in shortfalls if problem])
