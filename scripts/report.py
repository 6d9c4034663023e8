from pathlib import Path

from draftflow.report import build_report
from draftflow.rule_log import logged

with logged(snakemake.log[0]):
    inputs = snakemake.input
    build_report(
        snakemake.params.run,
        [Path(p) for p in inputs.benchmarks],
        {name: Path(path) for name, path in inputs.items() if name != "benchmarks" and path},
        {name: Path(snakemake.output[name]) for name in ("runtimes", "plot", "sets_plot", "epochs_plot", "markdown")},
        {run: Path(results) for run, results in snakemake.params.compared.items()},
    )
