from pathlib import Path

from draftflow.rule_log import logged
from draftflow.training_data import build_view, split_rows, write_split

with logged(snakemake.log[0]):
    dataset = Path(snakemake.input.dataset)
    train_rows, heldout_rows, evaluation_rows = split_rows(dataset, snakemake.params.heldout_fraction, snakemake.params.seed)
    if not train_rows or not heldout_rows:
        raise ValueError(
            f"train.heldout_fraction={snakemake.params.heldout_fraction} leaves "
            f"{len(train_rows)} training and {len(heldout_rows)} held-out samples; both need some."
        )
    summary = Path(snakemake.input.hidden_states)
    build_view(dataset, summary, train_rows, Path(snakemake.output.train))
    build_view(dataset, summary, heldout_rows, Path(snakemake.output.heldout))
    build_view(dataset, summary, evaluation_rows, Path(snakemake.output.evaluation))
    write_split(Path(snakemake.output.split), train_rows, heldout_rows, evaluation_rows)
    print(f"{len(train_rows)} training samples, {len(heldout_rows)} held out, {len(evaluation_rows)} in evaluation sets")
