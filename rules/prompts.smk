rule prompts:
    input:
        prompt_files=config["data"]["prompt_files"],
    output:
        conversations=result("prompts/conversations.jsonl"),
        stats=result("prompts/stats.json"),
    log:
        log_path("prompts"),
    benchmark:
        benchmark_path("prompts")
    conda:
        CONDA_ENV
    params:
        num_samples=config["data"]["num_samples"],
        seed=config["seed"],
        on_bad_row=config["data"]["on_bad_row"],
    script:
        "../scripts/prompts.py"
