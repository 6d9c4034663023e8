"""The drafter as it ships: ``results/<run>/drafter/``, the trained drafter's files (linked,
not copied) and its model card, ``README.md``, with Hugging Face front matter.

The card says how the drafter was made and how well it drafts: the base model, the data
mix and the evaluation sets, the generation settings, the layers and the draft
vocabulary, the acceptance per set and K offline and served (``acceptance_tables``),
the digests of its own files and of the run's inputs, and the ``vllm serve`` command
that serves it. ``draftflow publish`` uploads the folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from pathlib import Path

import yaml

from draftflow.acceptance_tables import TEMPERATURE_NOTE, category_tables, sets_table, temperature_table
from draftflow.io import atomic_path
from draftflow.sampling import sampling_text

CARD = "README.md"
TAGS = ["speculative-decoding", "eagle3", "speculators", "draftflow"]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while block := stream.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def base_model(target: dict) -> str:
    """The target as the hub names it (its id where it came from the hub), else its folder's name."""
    return target["hub"]["repo_id"] if target.get("hub") else Path(target["path"]).name


def hub_datasets(sources: dict) -> list[str]:
    """The hub dataset ids among the prompt sources (front matter lists hub ids only)."""
    return sorted({source["origin"].removeprefix("hub:").split("@")[0] for source in sources.values()
                   if source["origin"].startswith("hub:")})  # fmt: skip


def front_matter(inputs: dict, settings: dict) -> dict:
    prompts = inputs["prompts"]
    matter = {
        "base_model": base_model(settings["target"]),
        "library_name": "speculators",
        "pipeline_tag": "text-generation",
        "tags": TAGS,
    }
    if datasets := hub_datasets({**prompts["sources"], **prompts["evaluation_sets"]}):
        matter["datasets"] = datasets
    return matter


def serve_command(settings: dict, drafter_ref: str) -> str:
    """The command that serves target and drafter as serve_check served them (the target as the
    config names it, its server flags), the drafter from ``drafter_ref``."""
    target = settings["target"]
    speculative = {"model": drafter_ref, "method": "eagle3", "num_speculative_tokens": settings["draft_tokens"]}
    served = target["hub"]["repo_id"] if target.get("hub") else target["path"]
    return shlex.join(["vllm", "serve", served, *settings["server_args"], "--speculative-config", json.dumps(speculative)])


def mix_lines(prompts: dict) -> list[str]:
    lines = ["| source | origin | asked | rows read | unique | sampled |", "|" + " --- |" * 6]
    for name, source in prompts["sources"].items():
        asked = f"count {source['count']}" if source["count"] else f"weight {source['weight']}" if source["weight"] else "pooled"
        lines.append(f"| {name} | `{source['origin']}` | {asked} | {source['rows_read']:,} | {source['unique']:,} | {source['sampled']:,} |")
    for name, listed in prompts["evaluation_sets"].items():
        lines.append(f"| {name} (evaluation only) | `{listed['origin']}` | all | {listed['rows_read']:,} | {listed['unique']:,} | {listed['sampled']:,} |")
    return lines


def card_text(inputs: dict, settings: dict, files: dict[str, str]) -> str:
    """The model card: ``inputs`` are the run's records (prompts, generate and train stats, the
    vocabulary's coverage, the extraction plan, evaluation, served, provenance), ``settings``
    what the rule passes (target, draft tokens, generation settings, run), ``files`` the
    drafter's files and their sha256."""
    plan, coverage, generated = inputs["plan"], inputs["coverage"], inputs["generate"]
    evaluation, served, provenance = inputs["evaluation"], inputs.get("served"), inputs["provenance"]
    drafter_ref = f"results/{settings['run']}/drafter"
    generation = settings["generation"]
    heldout = evaluation["trained"]
    lines = [
        "---", yaml.safe_dump(front_matter(inputs, settings), sort_keys=False).rstrip(), "---", "",
        f"# EAGLE-3 drafter for {base_model(settings['target'])}", "",
        f"Built by draftflow (run `{settings['run']}`, workflow commit `{provenance.get('workflow_commit')}`) "
        "in speculators' format; vLLM serves it beside the target.", "",
        "## Serve it", "", "```bash", serve_command(settings, drafter_ref), "```", "",
        f"(`{drafter_ref}` is this folder; published, its hub id.)", "",
        "## Acceptance", "",
        f"Held-out training prompts at K={evaluation['draft_tokens']}: mean acceptance length "
        f"{heldout['mean_acceptance_length']:.3f} offline (every position), "
        f"{heldout['decoding_replay']['mean_acceptance_length']:.3f} along the decoding replay"
        + (f", {served['mean_acceptance_length']:.3f} served by vLLM." if served else "."), "",
        *sets_table(evaluation, served), "",
        "samples: answered turns (a two-turn question gives two). τ: mean acceptance length (1 + accepted drafts "
        "per step) at temperature 0, each answer decoded up to "
        f"{generation['max_tokens']} tokens.", "",
        *category_tables(evaluation, served),
        f"By temperature (held-out prompts, K={evaluation['draft_tokens']}):", "",
        *temperature_table(evaluation, served), "", TEMPERATURE_NOTE, "",
        "## How it was made", "",
        f"- data: {inputs['prompts']['sampled']:,} training conversations mixed from the sources below; the "
        "evaluation sets are never trained on (the prompts stage refuses an overlap)", "",
        *mix_lines(inputs["prompts"]), "",
        f"- generation: the target answered every conversation (vLLM, max_tokens {generation['max_tokens']}, "
        f"sampling {sampling_text(generated['sampling'])}; chat template: "
        f"{generated['chat_template']['source']}, sha256 {generated['chat_template']['sha256'][:16]})",
        f"- hidden states: layers {plan['layer_ids'][:-1]} (aux) and {plan['layer_ids'][-1]} (final), "
        f"{plan['storage']} storage, {plan['samples']:,} samples",
        f"- draft vocabulary: {coverage['draft_vocab_size']:,} of the target's {coverage['target_vocab_size']:,} "
        f"tokens, covering {100 * coverage['coverage']:.1f}% of the answer tokens",
        f"- training: {inputs['train'].get('epochs')} epochs, {inputs['train'].get('steps')} steps, final loss "
        f"{inputs['train'].get('final_loss', float('nan')):.3f} ({inputs['train'].get('trainer')})", "",
        "## Provenance", "",
        f"- target fingerprint (config, weights, tokenizer, chat template): `{provenance['target']['fingerprint']}`",
        "- packages: " + ", ".join(f"{name} {version}" for name, version in provenance["packages"].items()),
        *[f"- `{name}`: sha256 `{digest}`" for name, digest in files.items()], "",
    ]  # fmt: skip
    return "\n".join(lines)


def parse_front_matter(text: str) -> dict:
    """The YAML between a card's opening ``---`` lines, as the hub reads it."""
    _, matter, _ = text.split("---\n", 2)
    return yaml.safe_load(matter)


def drafter_files(folder: Path) -> list[Path]:
    """A drafter folder's files, without hidden ones (Snakemake's .snakemake_timestamp)."""
    return [path for path in sorted(folder.iterdir()) if path.is_file() and not path.name.startswith(".")]


def write_release(trained: Path, inputs: dict, settings: dict, output: Path) -> None:
    """``output``: links to the trained drafter's files and the model card."""
    files = {path.name: sha256(path) for path in drafter_files(trained)}
    with atomic_path(output) as folder:
        folder.mkdir()
        for name in files:  # relative links: the run folder moves whole
            (folder / name).symlink_to(os.path.relpath(trained.resolve() / name, output.resolve()))
        (folder / CARD).write_text(card_text(inputs, settings, files))
