from pathlib import Path

import torch._dynamo
from datasets import load_from_disk

from draftflow.evaluate import (
    TargetHead,
    check_layer_ids,
    evaluate,
    gate,
    gate_failure,
    plot_acceptance,
)
from draftflow.io import read_json, write_json
from draftflow.rule_log import logged
from draftflow.train import load_drafter
from draftflow.training_data import check_view

# speculators compiles the drafter's forward whenever CUDA is available; evaluation runs it on
# CPU tensors, where inductor's generated C++ did not build (H200 image, torch 2.11). Evaluate
# without compiling, as on a machine without CUDA.
torch._dynamo.config.disable = True

params = snakemake.params
with logged(snakemake.log[0]):
    layer_ids = read_json(snakemake.input.plan)["layer_ids"]
    heldout = Path(snakemake.input.heldout)
    print(f"{check_view(heldout)} held-out files hold their rows' token ids")
    rows = load_from_disk(str(heldout)).with_format(None)
    samples = [
        (row, ids, mask)
        for row, (ids, mask) in enumerate(zip(rows["input_ids"], rows["loss_mask"], strict=True))
    ]
    head = TargetHead(Path(snakemake.input.target))
    results = {"draft_tokens": params.draft_tokens, "heldout_samples": len(samples)}
    for name, drafter_dir in (("trained", snakemake.input.drafter), ("untrained", snakemake.input.init)):
        check_layer_ids(read_json(Path(drafter_dir) / "config.json"), layer_ids, Path(drafter_dir))
        drafter = load_drafter(Path(drafter_dir), params.attention)
        results[name] = evaluate(drafter, head, heldout, samples, params.draft_tokens, params.served)
        print(name, results[name])
    results["gate"] = gate(results, params.min_acceptance_length)
    write_json(snakemake.output.evaluation, results)
    plot_acceptance(results, Path(snakemake.output.plot))
    if failure := gate_failure(results):
        raise SystemExit(failure)
