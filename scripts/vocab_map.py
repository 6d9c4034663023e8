from pathlib import Path

from draftflow.rule_log import logged
from draftflow.target_model import read_target_model
from draftflow.vocab import build_vocab_map, plot_coverage

with logged(snakemake.log[0]):
    target = read_target_model(snakemake.input.target)
    target.check_draft_vocab_size(snakemake.params.draft_vocab_size)
    summary = build_vocab_map(
        Path(snakemake.input.token_freq),
        target.vocab_size,
        snakemake.params.draft_vocab_size,
        snakemake.params.coverage_sizes,
        d2t_output=Path(snakemake.output.d2t),
        t2d_output=Path(snakemake.output.t2d),
        coverage_output=Path(snakemake.output.coverage),
    )
    plot_coverage(summary, Path(snakemake.output.plot))
    print(f"coverage {100 * summary['coverage']:.1f}% at K={summary['draft_vocab_size']}")
