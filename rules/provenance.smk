PROVENANCE_STAGES = [
    stage.rule for stage in run_folder.stages_before_report(SERVE_CHECK, PILOT)
]


localrules:
    provenance,


rule provenance:
    input:
        rules.report.output,
        [getattr(rules, stage).input for stage in PROVENANCE_STAGES],
        target=TARGET,
    output:
        provenance=result("provenance.json"),
    log:
        log_path("provenance"),
    benchmark:
        benchmark_path("provenance")
    conda:
        CONDA_ENV
    params:
        depends=depends_on("provenance"),
        code=code_version("provenance"),
        target_hub=TARGET_SOURCE.hub_record(),
        stage_inputs={
            stage: [str(path) for path in getattr(rules, stage).input]
            for stage in PROVENANCE_STAGES
        },
    script:
        "../scripts/provenance.py"
