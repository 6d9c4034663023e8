localrules:
    model_card,


rule model_card:
    input:
        drafter=rules.train.output.drafter,
        prompts=rules.prompts.output.stats,
        generate=rules.generate.output.stats,
        train=rules.train.output.stats,
        coverage=rules.vocab_map.output.coverage,
        plan=rules.extract_plan.output.plan,
        evaluation=rules.evaluate.output.evaluation,
        served=rules.serve_check.output.served if SERVE_CHECK else [],
        provenance=rules.provenance.output.provenance,
    output:
        drafter=directory(result(run_folder.DRAFTER)),
    log:
        log_path("model_card"),
    benchmark:
        benchmark_path("model_card")
    conda:
        CONDA_ENV
    params:
        depends=depends_on("model_card"),
        code=code_version("model_card"),
        settings={
            "run": RUN,
            "target": {
                "path": config["target"]["path"],
                "hub": TARGET_SOURCE.hub_record(),
            },
            "draft_tokens": config["evaluate"]["draft_tokens"],
            "server_args": SERVED_FLAGS,
            "generation": {"max_tokens": config["generate"]["max_tokens"]},
        },
    script:
        "../scripts/model_card.py"
