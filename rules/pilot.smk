rule pilot:
    input:
        init=rules.drafter_init.output.drafter,
        dataset=rules.prepare.output.dataset,
        hidden_states=rules.extract.output.summary,
        split=rules.train_views.output.split,
        heldout=rules.train_views.output.heldout,
        drafter=rules.train.output.drafter,
        generation=rules.generate.output.stats,
        target=TARGET,
    output:
        pilot=result(PILOT_FILE),
        plot=report(
            result("pilot/pilot.png"),
            caption="../report/pilot.rst",
            category="Training",
        ),
    log:
        log_path("pilot"),
    benchmark:
        benchmark_path("pilot")
    conda:
        CONDA_ENV
    resources:
        gpu=config["train"]["gpus"] if config["device"] == "cuda" else 0,
    params:
        depends=depends_on("pilot"),
        code=code_version("pilot"),
        settings=train_settings(),
        selection={
            "draft_tokens": config["evaluate"]["draft_tokens"],
            "max_tokens": config["generate"]["max_tokens"],
        },
        requests=config["evaluate"]["serve_check_requests"],
        num_samples=config["data"]["num_samples"],
        pilot={
            k: config["pilot"][k]
            for k in (
                "fractions",
                "predict_for",
                "target_acceptance_length",
                "bootstrap_draws",
            )
        },
        work_dir=result("pilot/work"),
    script:
        "../scripts/pilot.py"
