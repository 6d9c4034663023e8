"""Stage 8: one page on what each stage cost and what the run produced."""

from __future__ import annotations

import csv
from pathlib import Path

from draftflow import run_folder
from draftflow.acceptance_tables import TEMPERATURE_NOTE, category_tables, plot_sets, sets_table, temperature_table
from draftflow.epoch_selection import curve_lines, describe, plot_curve
from draftflow.pilot import summary_lines
from draftflow.extract import layout
from draftflow.io import atomic_path, read_json, write_text
from draftflow.plots import pyplot, save_png
from draftflow.sampling import sampling_text

COLUMNS = ("stage", "jobs", "seconds", "max_rss_mb", "cpu_seconds", "work", "throughput")
COMPARED_FILES = {"extract": f"{run_folder.HIDDEN_STATES}/{layout.SUMMARY}",
                  "evaluation": f"{run_folder.EVALUATION}/evaluation.json",
                  "served": f"{run_folder.EVALUATION}/served.json"}  # fmt: skip


def read_benchmark(path: Path) -> dict:
    with path.open() as stream:
        row = next(csv.DictReader(stream, delimiter="\t"))
    number = lambda key: float(row[key]) if row.get(key) not in (None, "", "NA", "-") else 0.0  # noqa: E731
    return {"seconds": number("s"), "max_rss_mb": number("max_rss"), "cpu_seconds": number("cpu_time")}


def gather_runtimes(benchmarks: list[Path]) -> dict[str, dict]:
    stages: dict[str, dict] = {}
    for path in benchmarks:
        numbers = read_benchmark(path)
        stage = stages.setdefault(run_folder.stage_of_benchmark(path), {"jobs": 0, "seconds": 0.0, "max_rss_mb": 0.0, "cpu_seconds": 0.0})
        stage["jobs"] += 1
        stage["seconds"] += numbers["seconds"]
        stage["cpu_seconds"] += numbers["cpu_seconds"]
        stage["max_rss_mb"] = max(stage["max_rss_mb"], numbers["max_rss_mb"])
    return stages


def rate(amount: float, seconds: float, unit: str) -> str:
    return f"{amount / seconds:,.1f} {unit}/s" if seconds else "n/a"


def stage_work(stats: dict, runtimes: dict) -> dict[str, tuple[str, str]]:
    """Per stage: (what it processed, its throughput), from the stages' own stats."""
    seconds = lambda stage: runtimes.get(stage, {}).get("seconds", 0.0)  # noqa: E731
    generated, prepared, extracted, trained = (
        stats["generate"], stats["prepare"], stats["extract"], stats["train"]
    )
    return {
        "prompts": (f"{stats['prompts']['sampled']} conversations", rate(stats["prompts"]["sampled"], seconds("prompts"), "conversations")),
        "generate_server": (
            f"{generated['samples']} samples, {generated['response_tokens']:,} response tokens",
            f"{generated['response_tokens_per_second']:,.1f} tokens/s per server (server up)",
        ),
        "prepare": (f"{prepared['kept']} samples, {prepared['tokens']:,} tokens", rate(prepared["tokens"], seconds("prepare"), "tokens")),
        "extract_server": (
            f"{extracted['samples']} samples, {extracted['tokens']:,} tokens, {extracted['bytes'] / 1e6:,.1f} MB written",
            f"{rate(extracted['tokens'], seconds('extract_server'), 'tokens')}, {rate(extracted['bytes'] / 1e6, seconds('extract_server'), 'MB')}",
        ),
        "train": (f"{trained.get('steps', 'n/a')} steps", f"{trained.get('supervised_tokens_per_second', 0):,.1f} supervised tokens/s"),
    }


def write_runtimes_tsv(rows: list[dict], output: Path) -> None:
    with atomic_path(output) as tmp, tmp.open("w", newline="") as stream:
        writer = csv.DictWriter(stream, COLUMNS, delimiter="\t")
        writer.writeheader()
        writer.writerows(rows)


def runtime_rows(runtimes: dict, work: dict) -> list[dict]:
    return [
        {
            "stage": stage,
            "jobs": numbers["jobs"],
            "seconds": round(numbers["seconds"], 2),
            "max_rss_mb": round(numbers["max_rss_mb"], 1),
            "cpu_seconds": round(numbers["cpu_seconds"], 2),
            "work": work.get(stage, ("", ""))[0],
            "throughput": work.get(stage, ("", ""))[1],
        }
        for stage, numbers in runtimes.items()
    ]


def plot_runtimes(rows: list[dict], output: Path) -> None:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.2))
    axis.barh([row["stage"] for row in rows], [row["seconds"] for row in rows])
    for index, row in enumerate(rows):
        axis.annotate(f"{row['seconds']:.1f} s", (row["seconds"], index), xytext=(4, -4), textcoords="offset points")
    axis.invert_yaxis()
    axis.set(xlabel="wall time (s, summed over a stage's jobs)", title="Runtime per stage")
    save_png(figure, output)


def generation_lines(generated: dict) -> list[str]:
    """The generation bullet, with the user turns lost to ``generate.max_tokens``, and its warnings."""
    summary = (
        f"- generation: {generated['samples']} samples, {generated['errors']} errors, reasoning captured in "
        f"{100 * generated['reasoning_capture_rate']:.1f}%, mean {generated['mean_prompt_tokens']:.0f} prompt / "
        f"{generated['mean_response_tokens']:.0f} response tokens; {generated['conversations_with_lost_turns']} of "
        f"{generated['conversations']} conversations ({generated['multi_turn_conversations']} multi-turn) lost "
        f"{generated['user_turns_lost']} of {generated['user_turns']} user turns to generate.max_tokens; "
        f"sampling {sampling_text(generated['sampling'])}; {generated['too_long']} conversations too long for "
        f"vllm.max_model_len never asked, {generated['overflowed']} refused in a later turn (ids in stats.json)"
    )
    return [summary] + [f"- **Warning (generate):** {warning}" for warning in generated["warnings"]]


def storage_line(extracted: dict) -> str:
    return (
        f"- hidden states: {extracted['storage']} storage ({extracted['dtype']} model), "
        f"{extracted['bytes'] / extracted['tokens']:,.1f} bytes per token, {extracted['bytes'] / 1e6:,.1f} MB "
        f"in {extracted['samples']} files"
    )


def run_outcome(results: Path) -> dict:
    """What the comparison table shows of a finished run: storage, bytes per token, acceptance."""
    paths = {name: results / path for name, path in COMPARED_FILES.items()}
    if missing := [str(path) for name, path in paths.items() if name != "served" and not path.exists()]:
        raise FileNotFoundError(
            f"report.compare_runs names {results.name}, but {', '.join(missing)} does not exist: "
            "finish that run first (snakemake --configfile <its config>), or drop it from report.compare_runs."
        )
    served = read_json(paths["served"]) if paths["served"].exists() else None
    return outcome(read_json(paths["extract"]), read_json(paths["evaluation"]), served)


def outcome(extracted: dict, evaluation: dict, served: dict | None) -> dict:
    # runs extracted before extract.storage existed stored full precision
    return {"storage": extracted.get("storage", "full"), "bytes_per_token": extracted["bytes"] / extracted["tokens"],
            "samples": extracted["samples"], "offline": evaluation["trained"]["mean_acceptance_length"],
            "served": served["mean_acceptance_length"] if served else None}  # fmt: skip


def comparison_lines(run: str, this: dict, compared: dict[str, dict]) -> list[str]:
    lines = ["## Compared runs", "", "| run | storage | bytes per token | samples | mean acceptance length (offline) | Δ | served | Δ |",
             "|" + " --- |" * 8]  # fmt: skip
    for name, outcome in {run: this, **compared}.items():
        delta = lambda key: "" if outcome[key] is None or this[key] is None or name == run else f"{outcome[key] - this[key]:+.3f}"  # noqa: E731
        served = "n/a" if outcome["served"] is None else f"{outcome['served']:.3f}"
        lines.append(f"| {name} | {outcome['storage']} | {outcome['bytes_per_token']:,.1f} | {outcome['samples']} | "
                     f"{outcome['offline']:.3f} | {delta('offline')} | {served} | {delta('served')} |")  # fmt: skip
    return [*lines, ""]


def fidelity_line(fidelity: dict) -> str:
    if not fidelity["checked"]:
        return f"- extraction fidelity (vLLM vs transformers): {fidelity['reason']}"
    errors = ", ".join(f"{k}: {v:.1e}" for k, v in fidelity["max_relative_error_per_layer"].items())
    greedy = fidelity["greedy_agreement"]
    agreement = (f"transformers' greedy choice agrees with {greedy['share']:.1%} of {greedy['answer_tokens']} answer tokens"
                 if greedy["checked"] else f"greedy agreement not checked: {greedy['reason']}")  # fmt: skip
    return f"- extraction fidelity (vLLM vs transformers, max relative error per layer): {errors}; {agreement}"


def markdown(run: str, rows: list[dict], stats: dict, compared: dict[str, dict]) -> str:
    coverage, evaluation, fidelity = stats["coverage"], stats["evaluation"], stats["fidelity"]
    lines = [f"# draftflow report: {run}", "", "## Stages", "", "| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(row[c]) for c in COLUMNS) + " |" for row in rows]
    lines += ["", "![runtime per stage](stage_runtimes.png)", "", "## Data", ""]
    lines += generation_lines(stats["generate"])
    lines += [
        f"- draft vocabulary: {100 * coverage['coverage']:.1f}% of loss-masked tokens covered at "
        f"K={coverage['draft_vocab_size']} (target vocabulary {coverage['target_vocab_size']})",
        storage_line(stats["extract"]),
        fidelity_line(fidelity),
        "",
        "## Acceptance (held-out samples)",
        "",
        "| drafter | mean acceptance length | " + " | ".join(f"pos {k}" for k in range(1, evaluation["draft_tokens"] + 1)) + " |",
        "|" + " --- |" * (evaluation["draft_tokens"] + 2),
    ]
    drafters = [(f"{name} (offline, every position)", evaluation[name]) for name in ("trained", "untrained")]
    replay = evaluation["trained"]["decoding_replay"]
    drafters.append((f"trained (offline, decoding replay of {replay['requests']} prompts: predicts serving)", replay))
    if served := stats.get("served"):
        drafters.append(("trained, served by vLLM", served))
    for name, numbers in drafters:
        per_position = " | ".join(f"{100 * a:.1f}%" for a in numbers["acceptance_per_position"])
        lines.append(f"| {name} | {numbers['mean_acceptance_length']:.3f} | {per_position} |")
    gate = evaluation["gate"]
    lines += [
        "",
        "Every position: a chain scored at each answer token (the training metric; the gate reads it, "
        "at evaluate.gate_temperature). "
        "Decoding replay: the chains decoding visits, jumping a + 1 after a accepted drafts, on the prompts "
        "serve_check serves (what vLLM's counters should say).",
        "",
        f"Gate: mean acceptance length at temperature {gate['temperature']:g} ≥ {gate['min_acceptance_length']}: "
        f"{'passed' if gate['passed'] else 'FAILED'} ({gate['mean_acceptance_length']:.3f}).", "",
        "![acceptance](../evaluation/acceptance.png)", "",
    ]  # fmt: skip
    if served:
        lines += ["![offline and served](../evaluation/served_acceptance.png)", ""]
    lines += ["## The epoch shipped", "", f"Shipped: {describe(stats['train']['selection'])}.", "",
              *curve_lines(stats["train"]["selection"]), "", "![acceptance per epoch](epochs.png)", ""]  # fmt: skip
    if pilot := stats.get("pilot"):
        lines += ["## What more data buys (pilot)", "", "Drafters trained on nested fractions of the training samples "
                  "(each with the run's recipe, the best epoch shipped), on the held-out requests the decoding replay walks:",
                  "", *summary_lines(pilot), "", "![the pilot's points and fit](../pilot/pilot.png)", ""]  # fmt: skip
    lines += ["## Acceptance by temperature (held-out samples)", "", *temperature_table(evaluation, served), "", TEMPERATURE_NOTE, ""]
    lines += ["## Acceptance by evaluation set", "", *sets_table(evaluation, served), "",
              "samples: answered turns (a two-turn question gives two). τ: mean acceptance length (1 + accepted "
              "drafts per step), at temperature 0, each answer decoded up to generate.max_tokens.", "", *category_tables(evaluation, served),
              "![acceptance by set](acceptance_by_set.png)", ""]  # fmt: skip
    if compared:
        lines += comparison_lines(run, outcome(stats["extract"], evaluation, stats.get("served")), compared)
    return "\n".join(lines)


def build_report(
    run: str, benchmarks: list[Path], stat_files: dict[str, Path], outputs: dict[str, Path], compared_runs: dict[str, Path]
) -> None:
    """``compared_runs``: other runs' results folders, shown beside this run (report.compare_runs)."""
    compared = {name: run_outcome(results) for name, results in compared_runs.items()}  # fails before writing
    stats = {name: read_json(path) for name, path in stat_files.items()}
    runtimes = gather_runtimes(benchmarks)
    rows = runtime_rows(runtimes, stage_work(stats, runtimes))
    write_runtimes_tsv(rows, outputs["runtimes"])
    plot_runtimes(rows, outputs["plot"])
    plot_sets(stats["evaluation"], stats.get("served"), outputs["sets_plot"])
    plot_curve(stats["train"]["selection"], outputs["epochs_plot"])
    write_text(outputs["markdown"], markdown(run, rows, stats, compared))
