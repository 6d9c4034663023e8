"""draftflow: build EAGLE-3 speculative-decoding drafters with Snakemake."""
