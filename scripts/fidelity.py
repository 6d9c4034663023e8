from pathlib import Path

from draftflow.extract.backends import open_extractor
from draftflow.extract.fidelity import compare_with_reference, fidelity_failure, read_reference
from draftflow.extract.hidden_states import full_precision
from draftflow.extract.shards import load_samples
from draftflow.io import read_json, write_json
from draftflow.gpus import claim_gpus
from draftflow.rule_log import logged
from draftflow.training_data import extracted_states

params = snakemake.params


def vllm_states(record: dict) -> dict:
    """vLLM's states of the reference's samples, by sample id: as the extraction stored
    them (the files training reads; fp8 dequantized), or from a server of its own."""
    samples = [s for s in load_samples(Path(snakemake.input.dataset)) if s.sample_id in record["samples"]]
    server_log = Path(snakemake.log.server)
    if snakemake.input.extracted:
        server_log.write_text(f"No server: vLLM's states are read from {snakemake.input.extracted}\n")
        return extracted_states(Path(snakemake.input.extracted), samples)
    options = {**params.backend_options, "storage": read_json(snakemake.input.plan)["storage"]}
    with open_extractor("vllm", snakemake.input.target, record["layer_ids"], options, server_log) as extract:
        return {sample.sample_id: full_precision(hs) for sample, hs in extract(samples)}


with logged(snakemake.log.log), claim_gpus(snakemake.resources.gpu):
    record, reference = read_reference(Path(snakemake.input.reference).parent)
    if record["checked"]:
        result = {**compare_with_reference(record, reference, vllm_states(record), params.tolerance),
                  "greedy_agreement": record["greedy_agreement"], "reason": record["reason"]}  # fmt: skip
    else:
        Path(snakemake.log.server).write_text(f"No server: {record['reason']}\n")
        result = record
    write_json(snakemake.output.report, result)
    print(result)
    if failure := fidelity_failure(result):
        raise SystemExit(failure)
