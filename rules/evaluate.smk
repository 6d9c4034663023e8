rule evaluate:
    input:
        drafter=rules.train.output.drafter,
        init=rules.drafter_init.output.drafter,
        heldout=rules.train_views.output.heldout,
        plan=rules.extract_plan.output.plan,
        target=TARGET,
    output:
        evaluation=result("evaluation/evaluation.json"),
        plot=report(result("evaluation/acceptance.png"), category="Evaluation"),
    log:
        log_path("evaluate"),
    benchmark:
        benchmark_path("evaluate")
    conda:
        CONDA_ENV
    params:
        draft_tokens=config["evaluate"]["draft_tokens"],
        min_acceptance_length=config["evaluate"]["min_acceptance_length"],
        attention=config["train"]["attention"],
    script:
        "../scripts/evaluate.py"
