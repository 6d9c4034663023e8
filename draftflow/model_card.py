"""The drafter as it ships: ``results/<run>/drafter/``, the trained drafter's files (linked,
not copied) and its model card, ``README.md``, with Hugging Face front matter.

The card says how the drafter was made and how well it drafts: the base model, the data
mix and the evaluation sets, the generation settings, the layers and the draft
vocabulary, the acceptance per set and K offline and served (``acceptance_tables``),
the digests of its own files and of the run's inputs, and the ``vllm serve`` command
that serves it. ``draftflow publish`` uploads the folder, the card and the drafter's
``config.json`` naming the target by its hub id there (``published_card``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from pathlib import Path

import yaml

from draftflow.acceptance_tables import TEMPERATURE_NOTE, category_tables, sets_table, temperature_table
from draftflow.epoch_selection import curve_lines, describe
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
    config names it, its server flags, and generation's reasoning parser:
    vllm_support.served_flags), the drafter from ``drafter_ref``."""
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


def title(target_name: str) -> str:
    return f"# EAGLE-3 drafter for {target_name}"


def drafter_note(drafter_ref: str) -> str:
    """The line under the serve command that says where the drafter is."""
    return f"(`{drafter_ref}` is this folder; published, its hub id.)"


def digest_line(name: str, digest: str) -> str:
    return f"- `{name}`: sha256 `{digest}`"


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
        title(base_model(settings["target"])), "",
        f"Built by draftflow (run `{settings['run']}`, workflow commit `{provenance.get('workflow_commit')}`) "
        "in speculators' format; vLLM serves it beside the target.", "",
        "## Serve it", "", "```bash", serve_command(settings, drafter_ref), "```", "",
        drafter_note(drafter_ref), "",
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
        f"{inputs['train'].get('final_loss', float('nan')):.3f} ({inputs['train'].get('trainer')})",
        f"- shipped: {describe(inputs['train']['selection'])}", "",
        *curve_lines(inputs["train"]["selection"]), "",
        "## Provenance", "",
        f"- target fingerprint (config, weights, tokenizer, chat template): `{provenance['target']['fingerprint']}`",
        "- packages: " + ", ".join(f"{name} {version}" for name, version in provenance["packages"].items()),
        *[digest_line(name, digest) for name, digest in files.items()], "",
    ]  # fmt: skip
    return "\n".join(lines)


def parse_front_matter(text: str) -> dict:
    """The YAML between a card's opening ``---`` lines, as the hub reads it."""
    _, matter, _ = text.split("---\n", 2)
    return yaml.safe_load(matter)


def published_config(config: dict, verifier: str) -> dict:
    """The drafter's config as published: its verifier named by the hub id ``verifier``, where
    training wrote the target's local path (``draftflow.train.finalize_config``)."""
    speculators = config["speculators_config"]
    return {**config, "speculators_config": {**speculators, "verifier": {**speculators["verifier"], "name_or_path": verifier}}}


def published_card(card: str, verifier: str, repo_id: str, digests: dict[str, str]) -> str:
    """``card`` as the hub repository ``repo_id`` shows it: the target named by its hub id
    ``verifier`` (front matter, title, serve command), the drafter by ``repo_id``, and the
    ``digests`` of the files as uploaded."""
    _, matter, body = card.split("---\n", 2)
    matter = {**yaml.safe_load(matter), "base_model": verifier}
    lines = body.split("\n")
    for i, line in enumerate(lines):
        if line.startswith(title("")):
            lines[i] = title(verifier)
        elif line.startswith("vllm serve "):
            command = shlex.split(line)
            speculative = {**json.loads(command[-1]), "model": repo_id}
            lines[i] = shlex.join([*command[:2], verifier, *command[3:-1], json.dumps(speculative)])
        elif line.endswith(drafter_note("")[3:]):  # whatever folder it names
            lines[i] = f"(`{repo_id}` is this repository.)"
        elif line.startswith("- `") and ": sha256 `" in line and (name := line[3:].split("`", 1)[0]) in digests:
            lines[i] = digest_line(name, digests[name])
    return "---\n" + yaml.safe_dump(matter, sort_keys=False) + "---\n" + "\n".join(lines)


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
