HIDDEN_STATES = result("hidden_states")


localrules:
    extract_plan,
    extract,


rule extract_plan:
    input:
        dataset=rules.prepare.output.dataset,
        target=TARGET,
    output:
        plan=f"{HIDDEN_STATES}/{layout.PLAN}",
    log:
        log_path("extract_plan"),
    benchmark:
        benchmark_path("extract_plan")
    conda:
        CONDA_ENV
    params:
        code=code_version("extract_plan"),
        output_dir=lambda wildcards, output: Path(output[0]).parent,
        shards=config["extract"]["shards"],
        servers=EXTRACT_SERVERS,
        backend=config["extract"]["backend"],
        layer_ids=config["extract"]["layer_ids"],
        dtype=config["target"]["dtype"],
        storage=config["extract"]["storage"],
        disk_margin=config["extract"]["disk_margin"],
    script:
        "../scripts/extract_plan.py"


rule extract_server:
    input:
        plan=rules.extract_plan.output.plan,
        dataset=rules.prepare.output.dataset,
        target=TARGET,
    output:
        manifest=str(layout.server_manifest_path(HIDDEN_STATES, "{server}")),
    log:
        log=log_path("extract_server-{server}"),
        server=log_path("extract_server-{server}", "server.log"),
    benchmark:
        benchmark_path("extract_server-{server}")
    conda:
        CONDA_ENV
    resources:
        gpu=gpus_per_server(),
    params:
        code=code_version("extract_server"),
        output_dir=lambda wildcards, output: Path(output[0]).parent,
        backend=config["extract"]["backend"],
        backend_options=extract_backend_options(),
        write_threads=config["extract"]["write_threads"],
    script:
        "../scripts/extract_server.py"


rule extract:
    input:
        servers=expand(
            str(layout.server_manifest_path(HIDDEN_STATES, "{server}")),
            server=range(EXTRACT_SERVERS),
        ),
    output:
        summary=f"{HIDDEN_STATES}/{layout.SUMMARY}",
        progress=f"{HIDDEN_STATES}/{layout.PROGRESS_TABLE}",
        progress_json=f"{HIDDEN_STATES}/{layout.PROGRESS_JSON}",
    log:
        log_path("extract"),
    benchmark:
        benchmark_path("extract")
    conda:
        CONDA_ENV
    params:
        code=code_version("extract_gather"),
    script:
        "../scripts/extract_gather.py"


rule fidelity:
    input:
        plan=rules.extract_plan.output.plan,
        dataset=rules.prepare.output.dataset,
        target=TARGET,
        # with the vllm backend, the check reads vLLM's states from the extraction's files
        extracted=(
            rules.extract.output.summary
            if config["extract"]["backend"] == "vllm"
            else []
        ),
    output:
        report=result("fidelity/fidelity.json"),
    log:
        log=log_path("fidelity"),
        server=log_path("fidelity", "server.log"),
    benchmark:
        benchmark_path("fidelity")
    conda:
        CONDA_ENV
    resources:
        gpu=fidelity_job(config, FIDELITY.check, gpus_per_server())[0],
    params:
        code=code_version("fidelity"),
        setting=config["extract"]["fidelity"],
        device=config["device"],
        device_memory_gb=config["extract"]["fidelity_device_memory_gb"],
        samples=config["extract"]["fidelity_samples"],
        tolerance=fidelity_tolerance(
            config["extract"]["fidelity_tolerance"][config["target"]["dtype"]],
            config["extract"]["storage"],
        ),
        backend=config["extract"]["backend"],
        backend_options=extract_backend_options(),
        temperature=config["generate"]["temperature"],
        greedy_minimum=greedy_agreement_minimum(),
    script:
        "../scripts/fidelity.py"
