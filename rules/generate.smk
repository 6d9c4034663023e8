# generate.servers jobs each ask their share of the conversations (draftflow.answers.share)
# into files of their own; the gather writes generated.jsonl as one job would.
GENERATION_SETTINGS = {
    "max_tokens": config["generate"]["max_tokens"],
    "temperature": config["generate"]["temperature"],
    "concurrency": config["generate"]["concurrency"],
    "max_retries": config["generate"]["max_retries"],
    "seed": config["seed"],
    "reasoning_end_marker": config["generate"]["reasoning_end_marker"],
    "max_error_fraction": config["generate"]["max_error_fraction"],
    "max_degenerate_fraction": config["generate"]["max_degenerate_fraction"],
    "sampling": config["generate"]["sampling"],
    "chat_template_kwargs": config["generate"]["chat_template_kwargs"],
    "system_prompt": config["generate"]["system_prompt"],
}
GENERATION_SERVER = vllm_server_params(generation_server_flags(config, TARGET_MODEL))


rule generate_server:
    input:
        conversations=rules.prompts.output.conversations,
        target=TARGET,
    output:
        answered=answers.job_record(result("synthetic"), "{server}"),
    log:
        log=log_path("generate_server-{server}"),
        server=log_path("generate_server-{server}", "server.log"),
    benchmark:
        benchmark_path("generate_server-{server}")
    conda:
        CONDA_ENV
    resources:
        gpu=0 if config["generate"]["endpoint"] else gpus_per_server(),
    params:
        depends=depends_on("generate_server"),
        code=code_version("generate_server"),
        servers=GENERATE_SERVERS,
        endpoint=config["generate"]["endpoint"],
        api_key_env=config["generate"]["api_key_env"],
        work_dir=result(run_folder.ANSWER_STORES),
        server=GENERATION_SERVER,
        settings=GENERATION_SETTINGS,
    script:
        "../scripts/generate_server.py"


rule generate:
    input:
        conversations=rules.prompts.output.conversations,
        evaluation_sets=rules.prompts.output.evaluation_sets,
        target=TARGET,
        servers=[
            answers.job_record(result("synthetic"), server)
            for server in range(GENERATE_SERVERS)
        ],
    output:
        samples=result("synthetic/generated.jsonl"),
        errors=result("synthetic/errors.jsonl"),
        stats=result("synthetic/stats.json"),
    log:
        log_path("generate"),
    benchmark:
        benchmark_path("generate")
    conda:
        CONDA_ENV
    params:
        depends=depends_on("generate"),
        code=code_version("generate"),
        endpoint=config["generate"]["endpoint"],
        work_dir=result(run_folder.ANSWER_STORES),
        server_args=GENERATION_SERVER["args"],
        settings=GENERATION_SETTINGS,
    script:
        "../scripts/generate.py"
