"""Acceptance per evaluation set, per K and per category, as tables and a plot: the report
and the drafter's model card show the same ones.

They read ``evaluation.json``'s ``sets`` (offline: every position and the decoding
replay) and ``served.json``'s ``sets`` (vLLM's counters), both keyed set → ``draft_tokens``
→ K, with ``categories`` → category → ``draft_tokens`` → K; and both files'
``temperatures`` (the held-out slice at K = ``evaluate.draft_tokens``), keyed by temperature.
"""

from __future__ import annotations

from pathlib import Path

from draftflow.plots import pyplot, save_png


def served_numbers(served: dict | None, name: str, k: str, category: str | None = None) -> dict | None:
    if not served or name not in served.get("sets", {}):
        return None
    entry = served["sets"][name]
    if category is not None:
        entry = entry["categories"].get(category, {})
    return entry.get("draft_tokens", {}).get(k)


def set_rows(evaluation: dict, served: dict | None) -> list[dict]:
    """One row per set and K: samples, τ offline (every position, decoding replay), τ served."""
    rows = []
    for name, measured in evaluation["sets"].items():
        for k, offline in measured["draft_tokens"].items():
            by_vllm = served_numbers(served, name, k)
            rows.append({
                "set": name, "samples": measured["samples"], "k": int(k),
                "every_position": offline["mean_acceptance_length"],
                "decoding_replay": offline["decoding_replay"]["mean_acceptance_length"],
                "served": by_vllm["mean_acceptance_length"] if by_vllm else None,
                "acceptance_per_position": (by_vllm or offline["decoding_replay"])["acceptance_per_position"],
            })  # fmt: skip
    return rows


def shares_text(shares: list[float]) -> str:
    """Acceptance through each position, as percentages: "78%, 62%, 52%"."""
    return ", ".join(f"{100 * share:.0f}%" for share in shares)


def number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def sets_table(evaluation: dict, served: dict | None) -> list[str]:
    """Markdown: τ per set and K, offline and served, with the acceptance through each position."""
    lines = ["| set | samples | K | τ served (vLLM) | τ offline, decoding replay | τ offline, every position | "
             "accepted through position 1..K |", "|" + " --- |" * 7]  # fmt: skip
    for row in set_rows(evaluation, served):
        through = shares_text(row["acceptance_per_position"])
        lines.append(f"| {row['set']} | {row['samples']} | {row['k']} | {number(row['served'])} | "
                     f"{number(row['decoding_replay'])} | {number(row['every_position'])} | {through} |")  # fmt: skip
    return lines


def temperature_table(evaluation: dict, served: dict | None) -> list[str]:
    """Markdown: the held-out slice's τ at each temperature, served and offline, and whether
    serve_check held the served figure to the replay there."""
    lines = ["| temperature | τ served (vLLM) | drafts served | τ offline, decoding replay | τ offline, every position | "
             "served held to the replay |", "|" + " --- |" * 6]  # fmt: skip
    for key, offline in evaluation["temperatures"].items():
        by_vllm = (served or {}).get("temperatures", {}).get(key) or {}
        replay = offline["decoding_replay"]
        if "drafts" in by_vllm:
            held = ("yes" if key == "0" else "yes, within the noise of two draws") if replay else "no"
            cells = f"{by_vllm['mean_acceptance_length']:.3f} | {by_vllm['drafts']:.0f}"
        else:
            held, cells = "not served" + (f": {by_vllm['not_served']}" if by_vllm else ""), "n/a | n/a"
        lines.append(f"| {key} | {cells} | {number(replay['mean_acceptance_length'] if replay else None)} | "
                     f"{offline['mean_acceptance_length']:.3f} | {held} |")  # fmt: skip
    return lines


TEMPERATURE_NOTE = (
    "vLLM drafts greedily and accepts a draft with the target's probability of it at the served temperature "
    "(after top_k and top_p). Offline every position: that chance, followed along the answers (a lower bound "
    "where drafts leave them). The decoding replay predicts serving at temperature 0 and at the temperature the "
    "answers were sampled at (generate.temperature), where each answer is one draw of it; elsewhere none."
)


def category_tables(evaluation: dict, served: dict | None) -> list[str]:
    """Markdown, for each set with categories: τ per category at each K (served, else the replay)."""
    lines = []
    for name, measured in evaluation["sets"].items():
        if not measured["categories"]:
            continue
        ks = list(measured["draft_tokens"])
        lines += [f"**{name}** by category: τ served / offline (decoding replay)", "",
                  "| category | samples | " + " | ".join(f"K={k}" for k in ks) + " |", "|" + " --- |" * (len(ks) + 2)]  # fmt: skip
        for category, numbers in measured["categories"].items():
            cells = []
            for k in ks:
                by_vllm = served_numbers(served, name, k, category)
                offline = numbers["draft_tokens"][k]["decoding_replay"]["mean_acceptance_length"]
                cells.append(f"{number(by_vllm['mean_acceptance_length'] if by_vllm else None)} / {offline:.3f}")
            lines.append(f"| {category} | {numbers['samples']} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def plot_sets(evaluation: dict, served: dict | None, output: Path) -> None:
    """τ against K for each set: offline (decoding replay) solid, served by vLLM dashed."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 4))
    rows = set_rows(evaluation, served)
    for index, name in enumerate(dict.fromkeys(row["set"] for row in rows)):
        mine = [row for row in rows if row["set"] == name]
        color = f"C{index}"
        axis.plot([r["k"] for r in mine], [r["decoding_replay"] for r in mine], "o-", color=color, label=f"{name}, offline")
        if any(r["served"] is not None for r in mine):
            axis.plot([r["k"] for r in mine], [r["served"] for r in mine], "s--", color=color, label=f"{name}, served")
    axis.set(xlabel="draft tokens K (num_speculative_tokens)", ylabel="mean acceptance length τ",
             title="Acceptance by evaluation set", xticks=sorted({row["k"] for row in rows}))  # fmt: skip
    axis.legend(fontsize="small")
    save_png(figure, output)
