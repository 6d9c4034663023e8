from pathlib import Path

from draftflow.extract.backends import open_extractor
from draftflow.extract.fidelity import (
    decide,
    device_memory,
    greedy_agreement,
    greedy_failure,
    greedy_not_checked,
    not_checked,
    write_reference,
)
from draftflow.extract.shards import load_loss_masks, load_samples
from draftflow.gpus import claim_gpus
from draftflow.io import read_json
from draftflow.rule_log import logged
from draftflow.target_model import read_target_model

params = snakemake.params


def reference(target: str, layer_ids: list[int]) -> tuple[dict, dict]:
    """Transformers' states of the first samples, by sample id, and its greedy agreement
    with the answers (with greedy answers: its own choice after each position)."""
    samples = load_samples(Path(snakemake.input.dataset))[: params.samples]
    options = {**params.backend_options, "storage": "full"}
    with open_extractor("transformers", target, layer_ids, options, server_log=None) as extract:
        states = {sample.sample_id: hs for sample, hs in extract(samples)}
        if params.greedy_minimum is None:
            return states, greedy_not_checked(params.temperature)
        greedy = {sample_id: extract.greedy_next_tokens(hs) for sample_id, hs in states.items()}
    masks = load_loss_masks(Path(snakemake.input.dataset), len(samples))
    answers = {s.sample_id: (s.token_ids, mask) for s, mask in zip(samples, masks, strict=True)}
    return states, greedy_agreement(answers, greedy, params.greedy_minimum)


with logged(snakemake.log[0]), claim_gpus(snakemake.resources.gpu):
    memory = device_memory(params.device, params.device_memory_gb)
    decision = decide(params.setting, read_target_model(snakemake.input.target).weight_bytes, *memory)
    print(decision.reason)
    record, states = not_checked(decision), {}
    if decision.check:
        layer_ids = read_json(snakemake.input.plan)["layer_ids"]
        states, agreement = reference(snakemake.input.target, layer_ids)
        record = {"checked": True, "reason": decision.reason, "layer_ids": layer_ids, "samples": list(states),
                  "greedy_agreement": agreement}  # fmt: skip
        print(agreement)
        if failure := greedy_failure(agreement):
            raise SystemExit(failure)
    write_reference(Path(snakemake.output.record).parent, record, states)
