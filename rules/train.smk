localrules:
    train_views,


rule drafter_init:
    input:
        plan=rules.extract_plan.output.plan,
        d2t=rules.vocab_map.output.d2t,
        t2d=rules.vocab_map.output.t2d,
        target=TARGET,
    output:
        drafter=directory(result("drafter_untrained")),
    log:
        log_path("drafter_init"),
    benchmark:
        benchmark_path("drafter_init")
    conda:
        CONDA_ENV
    params:
        depends=depends_on("drafter_init"),
        code=code_version("drafter_init"),
        drafter_shape={
            "num_layers": config["train"]["num_layers"],
            "attention": config["train"]["attention"],
            "seed": config["seed"],
        },
    script:
        "../scripts/drafter_init.py"


rule train_views:
    input:
        dataset=rules.prepare.output.dataset,
        hidden_states=rules.extract.output.summary,
    output:
        train=directory(result("training_data/train")),
        heldout=directory(result("training_data/heldout")),
        evaluation=directory(result("training_data/evaluation")),
        split=result("training_data/split.json"),
    log:
        log_path("train_views"),
    benchmark:
        benchmark_path("train_views")
    conda:
        CONDA_ENV
    params:
        depends=depends_on("train_views"),
        code=code_version("train_views"),
        heldout_fraction=config["train"]["heldout_fraction"],
        seed=config["seed"],
    script:
        "../scripts/train_views.py"


rule train:
    input:
        init=rules.drafter_init.output.drafter,
        train=rules.train_views.output.train,
        heldout=rules.train_views.output.heldout,
        generation=rules.generate.output.stats,
        target=TARGET,
    output:
        drafter=directory(result(run_folder.TRAINED_DRAFTER)),
        stats=result("train/stats.json"),
    log:
        log_path("train"),
    benchmark:
        benchmark_path("train")
    conda:
        CONDA_ENV
    resources:
        gpu=config["train"]["gpus"] if config["device"] == "cuda" else 0,
    params:
        depends=depends_on("train"),
        code=code_version("train"),
        settings=train_settings(),
        selection={
            "draft_tokens": config["evaluate"]["draft_tokens"],
            "max_tokens": config["generate"]["max_tokens"],
        },
        work_dir=result("train/work"),
    script:
        "../scripts/train.py"
