from pathlib import Path

from draftflow.report import build_report
from draftflow.rule_log import logged

with logged(snakemake.log[0]):
    inputs = snakemake.input
    build_report(
        snakemake.params.run,
        [Path(p) for p in inputs.benchmarks],
        {name: Path(inputs[name]) for name in ("prompts", "generate", "prepare", "coverage", "extract", "fidelity", "train", "evaluation")},
        {name: Path(snakemake.output[name]) for name in ("runtimes", "plot", "markdown")},
    )
