from pathlib import Path

from draftflow.extract.backends import open_extractor
from draftflow.extract.hidden_states import full_precision
from draftflow.extract.shards import load_loss_masks, load_samples
from draftflow.extract.fidelity import (
    compare,
    decide,
    device_memory,
    fidelity_failure,
    greedy_agreement,
    greedy_not_checked,
    not_checked,
)
from draftflow.io import read_json, write_json
from draftflow.gpus import claim_gpus
from draftflow.rule_log import logged
from draftflow.target_model import read_target_model
from draftflow.training_data import extracted_states

params = snakemake.params


def check_fidelity(target: str) -> dict:
    plan = read_json(snakemake.input.plan)
    samples = load_samples(Path(snakemake.input.dataset))[: params.samples]
    states = {}  # transformers' in full precision; vllm's as stored (fp8: quantized by its connector)
    greedy = {}  # with greedy answers: transformers' own choice after each position, from its states
    if params.backend == "vllm":  # the files vLLM extracted, which training reads: no second server
        Path(snakemake.log.server).write_text(f"No server: vLLM's states are read from {snakemake.input.extracted}\n")
        states["vllm"] = extracted_states(Path(snakemake.input.extracted), samples)
    for backend, storage in (("transformers", "full"), ("vllm", plan["storage"])):
        if backend in states:
            continue
        options = {**params.backend_options, "storage": storage}
        with open_extractor(backend, target, plan["layer_ids"], options, Path(snakemake.log.server)) as extract:
            states[backend] = {sample.index: full_precision(hs) for sample, hs in extract(samples)}
            if backend == "transformers" and params.greedy_minimum is not None:
                greedy = {s.sample_id: extract.greedy_next_tokens(states[backend][s.index]) for s in samples}
    result = compare(states["transformers"], states["vllm"], plan["layer_ids"], params.tolerance)
    if not greedy:
        return result | {"greedy_agreement": greedy_not_checked(params.temperature)}
    masks = load_loss_masks(Path(snakemake.input.dataset), len(samples))
    answers = {s.sample_id: (s.token_ids, mask) for s, mask in zip(samples, masks, strict=True)}
    return result | {"greedy_agreement": greedy_agreement(answers, greedy, params.greedy_minimum)}


with logged(snakemake.log.log), claim_gpus(snakemake.resources.gpu):
    memory = device_memory(params.device, params.device_memory_gb)
    decision = decide(params.setting, read_target_model(snakemake.input.target).weight_bytes, *memory)
    print(decision.reason)
    result = {**check_fidelity(snakemake.input.target), "reason": decision.reason} if decision.check else not_checked(decision)
    write_json(snakemake.output.report, result)
    print(result)
    if failure := fidelity_failure(result):
        raise SystemExit(failure)
