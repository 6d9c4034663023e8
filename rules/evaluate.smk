rule evaluate:
    input:
        drafter=rules.train.output.drafter,
        init=rules.drafter_init.output.drafter,
        heldout=rules.train_views.output.heldout,
        evaluation=rules.train_views.output.evaluation,
        plan=rules.extract_plan.output.plan,
        generation=rules.generate.output.stats,
        target=TARGET,
    output:
        evaluation=result("evaluation/evaluation.json"),
        plot=report(
            result("evaluation/acceptance.png"),
            caption="../report/acceptance.rst",
            category="Evaluation",
        ),
    log:
        log_path("evaluate"),
    benchmark:
        benchmark_path("evaluate")
    conda:
        CONDA_ENV
    resources:
        gpu=1 if config["device"] == "cuda" else 0,
    params:
        depends=depends_on("evaluate"),
        code=code_version("evaluate"),
        device=config["device"],
        draft_tokens=config["evaluate"]["draft_tokens"],
        sweep=DRAFT_TOKEN_SWEEP,
        temperatures=config["evaluate"]["temperatures"],
        min_acceptance_length=config["evaluate"]["min_acceptance_length"],
        gate_temperature=gate_temperature(config["evaluate"], config["generate"]),
        attention=config["train"]["attention"],
        # what serve_check serves, for the decoding replay that predicts its counters
        served={
            "requests": config["evaluate"]["serve_check_requests"],
            "max_tokens": config["generate"]["max_tokens"],
        },
    script:
        "../scripts/evaluate.py"


rule serve_check:
    input:
        drafter=rules.train.output.drafter,
        init=rules.drafter_init.output.drafter,
        evaluation=rules.evaluate.output.evaluation,
        heldout=rules.train_views.output.heldout,
        evaluation_sets=rules.train_views.output.evaluation,
        generation=rules.generate.output.stats,
        target=TARGET,
    output:
        served=result("evaluation/served.json"),
        plot=report(
            result("evaluation/served_acceptance.png"),
            caption="../report/served_acceptance.rst",
            category="Evaluation",
        ),
    log:
        log=log_path("serve_check"),
        server=log_path("serve_check", "server.log"),
    benchmark:
        benchmark_path("serve_check")
    conda:
        CONDA_ENV
    resources:
        gpu=gpus_per_server(),
    params:
        depends=depends_on("serve_check"),
        code=code_version("serve_check"),
        draft_tokens=config["evaluate"]["draft_tokens"],
        sweep=DRAFT_TOKEN_SWEEP,
        temperatures=config["evaluate"]["temperatures"],
        max_tokens=config["generate"]["max_tokens"],
        max_requests=config["evaluate"]["serve_check_requests"],
        max_served_shortfall=config["evaluate"]["max_served_shortfall"],
        device=config["device"],
        server=vllm_server_params(SERVED_FLAGS),
    script:
        "../scripts/serve_check.py"
