from pathlib import Path

from draftflow.extract_backends import open_extractor
from draftflow.extraction import load_samples
from draftflow.fidelity import compare
from draftflow.io import read_json, write_json
from draftflow.gpus import claim_gpus
from draftflow.rule_log import logged

params = snakemake.params
with logged(snakemake.log.log), claim_gpus(snakemake.resources.gpu):
    plan = read_json(snakemake.input.plan)
    samples = load_samples(Path(snakemake.input.dataset))[: params.samples]
    states = {}
    for backend in ("transformers", "vllm"):
        with open_extractor(backend, snakemake.input.target, plan["layer_ids"], params.backend_options, Path(snakemake.log.server)) as extract:
            states[backend] = {sample.index: hs for sample, hs in extract(samples)}
    result = compare(states["transformers"], states["vllm"], plan["layer_ids"], params.tolerance)
    write_json(snakemake.output.report, result)
    print(result)
    if not result["passed"]:
        raise SystemExit(
            f"vLLM and transformers hidden states differ beyond {params.tolerance} "
            f"(relative, per layer id): {result['max_relative_error_per_layer']}. "
            "Check extract.layer_ids and the target's dtype before training on them."
        )
