rule generate:
    input:
        conversations=rules.prompts.output.conversations,
        evaluation_sets=rules.prompts.output.evaluation_sets,
        target=TARGET,
    output:
        samples=result("synthetic/generated.jsonl"),
        errors=result("synthetic/errors.jsonl"),
        stats=result("synthetic/stats.json"),
    log:
        log=log_path("generate"),
        server=log_path("generate", "server.log"),
    benchmark:
        benchmark_path("generate")
    conda:
        CONDA_ENV
    resources:
        gpu=0 if config["generate"]["endpoint"] else gpus_per_server(),
    params:
        depends=depends_on("generate"),
        code=code_version("generate"),
        endpoint=config["generate"]["endpoint"],
        api_key_env=config["generate"]["api_key_env"],
        work_dir=result("synthetic/work"),
        server=vllm_server_params(generation_server_flags(config, TARGET_MODEL)),
        settings={
            "max_tokens": config["generate"]["max_tokens"],
            "temperature": config["generate"]["temperature"],
            "concurrency": config["generate"]["concurrency"],
            "max_retries": config["generate"]["max_retries"],
            "seed": config["seed"],
            "reasoning_end_marker": config["generate"]["reasoning_end_marker"],
            "max_error_fraction": config["generate"]["max_error_fraction"],
            "max_degenerate_fraction": config["generate"]["max_degenerate_fraction"],
        },
    script:
        "../scripts/generate.py"
