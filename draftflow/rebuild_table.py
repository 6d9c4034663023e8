"""The rebuild table of docs/rebuilds.md, rendered from draftflow.dependencies: which stages an
edit reruns follows from what each stage reads; what generation asks and
extraction computes again, and the test that checks it, are this module's rows.

    python -m draftflow.rebuild_table   # the table, and the keys that change no output
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from draftflow.dependencies import NO_EFFECT, STAGES, downstream, reruns, stages_reading
from draftflow.server_flags import UNKEYED_SERVER_FLAGS


@dataclass(frozen=True)
class Rebuild:
    """A row of the rebuild table."""

    edit: str
    changes: tuple[str, ...]  # what stages_reading takes
    asked: str  # what generation asks again
    extracted: str  # what extraction computes again
    test: str  # tests/<file>::<test>
    check: str = "files"  # how the test checks it: a key of CHECKS


CHECKS = {
    "files": "the files a real run leaves",
    "dry run": "**dry run**: `snakemake -n`'s job table",
    "key": "**the key only**: no upgrade is run",
}


INCREMENTAL = "test_incremental_rebuilds.py::test_generation_asked_and_extraction_computed_exactly_what_the_edit_made_new"
REBUILDS = (
    Rebuild("`data.num_samples` grown (16 → 20)", ("data.num_samples",), "the 4 new conversations", "their 4 samples",
            f"{INCREMENTAL}[num_samples_grown]"),
    Rebuild("`data.num_samples` shrunk (20 → 16)", ("data.num_samples",), "none (0 requests)",
            "none; the files of the 4 samples left out are deleted", f"{INCREMENTAL}[num_samples_shrunk]"),
    # the next two edits are made together, in one run
    Rebuild("a prompt file added (the 16 drawn again from 30)", ("data.prompt_files",), "the newly drawn conversations",
            "their samples; files of samples no longer drawn are deleted", f"{INCREMENTAL}[prompt_files_edited]"),
    Rebuild("a prompt file edited in place (two questions reworded, same ids)", ("data.prompt_files",),
            "the reworded questions (or those drawn in their place)",
            "their samples: the same id with other tokens is extracted again", f"{INCREMENTAL}[prompt_files_edited]"),
    Rebuild("`generate.temperature` changed", ("generate.temperature",), "every conversation (another answer store)",
            "every sample whose tokens changed", f"{INCREMENTAL}[temperature_changed]"),
    Rebuild("`prepare.max_seq_length` lowered", ("prepare.max_seq_length",), "none (0 requests)",
            "the samples it cuts; the others keep their files", f"{INCREMENTAL}[max_seq_length_lowered]"),
    Rebuild("the target's `chat_template.jinja` edited", ("target:tokenizer",),
            "every conversation (another answer store)", "every sample whose tokens changed",
            f"{INCREMENTAL}[chat_template_edited]"),
    Rebuild("`--chat-template FILE` added to `vllm.extra_args`", ("vllm.extra_args",),
            "every conversation whose template text changed: all (another answer store)",
            "every sample whose tokens changed", f"{INCREMENTAL}[chat_template_flag_added]"),
    Rebuild("one tensor of the target's weights edited in place (a norm scaled by 1.01, the file saved over the old one)",
            ("target:model",), "every conversation (another answer store)", "every sample (another model)",
            f"{INCREMENTAL}[one_tensor_edited]"),
    Rebuild("`draftflow/extract/vllm_connector.py` edited (vllm backend)", ("extraction",), "none (generation is not rerun)",
            "every sample (other extraction code)",
            "test_rebuilds.py::test_editing_the_connector_extracts_every_sample_again_and_asks_nothing"),
    Rebuild("vLLM, torch or transformers upgraded", ("extraction",), "none (generation is not rerun)",
            "every sample (other builds)",
            "test_dependencies.py::test_the_extraction_key_follows_the_code_and_the_package_builds", check="key"),
    Rebuild("`train.lr`, `train.epochs`, `train.ttt_steps`", ("train.lr",), "—", "—",
            "test_rebuilds.py::test_config_edit_reruns_exactly_its_stages[train.lr]", check="dry run"),
    Rebuild("`vocab.draft_vocab_size`", ("vocab.draft_vocab_size",), "—", "—",
            "test_rebuilds.py::test_config_edit_reruns_exactly_its_stages[vocab.draft_vocab_size]", check="dry run"),
    Rebuild("`extract.layer_ids`", ("extract.layer_ids",), "—", "every sample",
            "test_rebuilds.py::test_config_edit_reruns_exactly_its_stages[extract.layer_ids]", check="dry run"),
    Rebuild("`evaluate.min_acceptance_length`", ("evaluate.min_acceptance_length",), "—", "—",
            "test_rebuilds.py::test_config_edit_reruns_exactly_its_stages[evaluate.min_acceptance_length]",
            check="dry run"),
    Rebuild("`extract.fidelity`", ("extract.fidelity",), "—", "none (the journals vouch for every file)",
            "test_rebuilds.py::test_config_edit_reruns_exactly_its_stages[extract.fidelity]", check="dry run"),
    Rebuild("`extract.fidelity_tolerance`", ("extract.fidelity_tolerance",), "—", "none",
            "test_rebuilds.py::test_a_new_fidelity_tolerance_reruns_the_comparison_and_leaves_the_reference_and_the_extraction"),
    Rebuild("`draftflow/train.py` edited", ("code:train",), "—", "—",
            "test_rebuilds.py::test_editing_training_code_reruns_training_not_generation", check="dry run"),
    Rebuild("`extract.shards`", ("extract.shards",), "—", "the samples that move to another shard",
            "test_rebuilds.py::test_changing_shard_count_reruns_the_extraction_jobs_not_generation", check="dry run"),
    Rebuild("`extract.servers` alone", ("extract.servers",), "—", "none: every shard's journal is complete, no server starts",
            "test_rebuilds.py::test_changing_the_server_count_reruns_the_server_jobs_which_load_nothing"),
)  # fmt: skip

# Edits of code whose stages the table names by the rules that run it.
CODE_STAGES = {"code:train": ("drafter_init", "train")}


def rebuild_reruns(row: Rebuild) -> list[str]:
    if row.changes[0] in CODE_STAGES:
        found = downstream(set(CODE_STAGES[row.changes[0]]))
        return [name for name in STAGES if name in found]
    return reruns(row.changes)


def render_rebuild_table() -> str:
    lines = [
        "| edit | stages rerun (**those that read it**, then those after them) | asked again | extracted again | checked by |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in REBUILDS:
        readers = set(CODE_STAGES.get(row.changes[0], ())).union(*(stages_reading(change) for change in row.changes))
        stages = ", ".join(f"**{name}**" if name in readers else name for name in rebuild_reruns(row))
        lines.append(f"| {row.edit} | {stages} | {row.asked} | {row.extracted} | `{row.test}` ({CHECKS[row.check]}) |")
    return "\n".join(lines) + "\n"


def render_no_effect_table() -> str:
    lines = ["| key | why no output changes |", "| --- | --- |"]
    lines += [f"| `{key}` | {why} |" for key, why in NO_EFFECT.items()]
    lines += [f"| the server flag `{flag}` | {why} |" for flag, why in UNKEYED_SERVER_FLAGS.items()]
    return "\n".join(lines) + "\n"


def main() -> int:
    """python -m draftflow.rebuild_table: print docs/rebuilds.md's two tables."""
    sys.stdout.write(render_rebuild_table() + "\n" + render_no_effect_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
