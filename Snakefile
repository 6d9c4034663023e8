from snakemake.utils import min_version, validate

min_version("9.0")


# The demo's config, unless a --configfile is given: a user's file stands alone, its
# missing keys taking the schema's defaults wherever Snakemake runs (Snakemake would
# otherwise merge it over config/config.yaml when run in the checkout).
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


validate(config, "draftflow/config_schema.yaml")


report: "report/workflow.rst"


wildcard_constraints:
    server=r"\d+",


include: "rules/common.smk"
include: "rules/demo_target.smk"
include: "rules/prompts.smk"
include: "rules/generate.smk"
include: "rules/prepare.smk"
include: "rules/vocab.smk"
include: "rules/extract.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"
include: "rules/pilot.smk"
include: "rules/report.smk"
include: "rules/provenance.smk"
include: "rules/model_card.smk"


rule all:
    default_target: True
    input:
        rules.report.output,
        rules.provenance.output,
        rules.model_card.output,


onstart:
    write_plan(
        config,
        Path(TARGET),
        Path(result("")),
        local_gpu_count() if snakemake_runs_locally() else None,
    )
