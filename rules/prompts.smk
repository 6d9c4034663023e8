rule prompts:
    input:
        prompt_files=source_files(PROMPT_SOURCES + EVALUATION_SETS),
    output:
        conversations=result("prompts/conversations.jsonl"),
        stats=result("prompts/stats.json"),
        evaluation_sets=result("prompts/evaluation_sets.json"),
    log:
        log_path("prompts"),
    benchmark:
        benchmark_path("prompts")
    conda:
        CONDA_ENV
    params:
        depends=depends_on("prompts"),
        code=code_version("prompts"),
        sources=[source.record() for source in PROMPT_SOURCES],
        evaluation_sets=[source.record() for source in EVALUATION_SETS],
        num_samples=config["data"]["num_samples"],
        seed=config["seed"],
        on_bad_row=config["data"]["on_bad_row"],
    script:
        "../scripts/prompts.py"
