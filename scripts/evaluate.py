import shutil
from pathlib import Path

import torch._dynamo

from draftflow.evaluate import (
    TargetHead,
    check_layer_ids,
    evaluate,
    evaluation_samples,
    gate,
    gate_evidence,
    gate_failure,
    keep_gate_evidence,
    measure,
    plot_acceptance,
    set_results,
)
from draftflow.gpus import claim_gpus
from draftflow.io import read_json, write_json
from draftflow.prompt_sources import HELDOUT
from draftflow.rule_log import logged
from draftflow.sampling import at_temperature, temperature_key
from draftflow.train import load_drafter
from draftflow.training_data import check_view

# speculators compiles the drafter's forward whenever CUDA is available; evaluation drafts each
# sample once, each of its own length (a compilation per shape), and on CPU tensors inductor's
# generated C++ did not build (H200 image, torch 2.11). Evaluate without compiling.
torch._dynamo.config.disable = True

params = snakemake.params
with logged(snakemake.log[0]), claim_gpus(snakemake.resources.gpu):
    layer_ids = read_json(snakemake.input.plan)["layer_ids"]
    views = {HELDOUT: Path(snakemake.input.heldout), "evaluation sets": Path(snakemake.input.evaluation)}
    for name, view in views.items():
        print(f"{check_view(view)} {name} files hold their rows' token ids")
    heldout = evaluation_samples(views[HELDOUT])[HELDOUT]
    head = TargetHead(Path(snakemake.input.target), params.device)
    results, drafters = {"draft_tokens": params.draft_tokens, "heldout_samples": len(heldout)}, {}
    for name, drafter_dir in (("trained", snakemake.input.drafter), ("untrained", snakemake.input.init)):
        check_layer_ids(read_json(Path(drafter_dir) / "config.json"), layer_ids, Path(drafter_dir))
        drafters[name] = load_drafter(Path(drafter_dir), params.attention).to(params.device)
    # the trained drafter on each set, the held-out slice first, at each K
    sets = {HELDOUT: (views[HELDOUT], heldout, params.served["requests"])}
    for name, samples in evaluation_samples(views["evaluation sets"]).items():
        sets[name] = (views["evaluation sets"], samples, len(samples))
    results["sets"] = {
        name: set_results(measure(drafters["trained"], head, view, samples, params.sweep, served, params.served["max_tokens"]),
                          params.served["max_tokens"])
        for name, (view, samples, served) in sets.items()
    }  # fmt: skip
    # the gate's figures: the trained drafter's are the held-out slice's at draft_tokens, measured above
    results["trained"] = results["sets"][HELDOUT]["draft_tokens"][str(params.draft_tokens)]
    results["untrained"] = evaluate(drafters["untrained"], head, views[HELDOUT], heldout, params.draft_tokens, params.served)
    for name in ("trained", "untrained"):
        print(name, results[name])
    # the trained drafter on the held-out slice at each temperature it may be served at
    generation = read_json(snakemake.input.generation)["sampling"]
    results["temperatures"] = {
        temperature_key(t): {"sampling": at_temperature(generation, t)["effective"],
                             **(results["trained"] if t == 0 else
                                evaluate(drafters["trained"], head, views[HELDOUT], heldout, params.draft_tokens, params.served,
                                         at_temperature(generation, t)["effective"], generation["effective"]["temperature"]))}
        for t in sorted({0, *params.temperatures, params.gate_temperature})
    }  # fmt: skip
    results["gate"] = gate(results, params.min_acceptance_length, params.gate_temperature)
    write_json(snakemake.output.evaluation, results)
    plot_acceptance(results, Path(snakemake.output.plot))
    shutil.rmtree(gate_evidence(Path(snakemake.output.evaluation)), ignore_errors=True)  # an earlier failure's
    if failure := gate_failure(results):
        kept = keep_gate_evidence(results, Path(snakemake.output.evaluation), Path(snakemake.output.plot))
        raise SystemExit(f"{failure} The evaluation, its plot and a report of why the gate failed stay in {kept}.")
