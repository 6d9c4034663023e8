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
        depends=depends_on("extract_plan"),
        code=code_version("extract_plan"),
        output_dir=lambda wildcards, output: Path(output[0]).parent,
        shards=config["extract"]["shards"],
        servers=EXTRACT_SERVERS,
        backend=config["extract"]["backend"],
        layer_ids=config["extract"]["layer_ids"],
        dtype=config["target"]["dtype"],
        storage=config["extract"]["storage"],
        disk_margin=config["extract"]["disk_margin"],
        server_args=TARGET_SERVER_FLAGS,
    script:
        "../scripts/extract_plan.py"


rule fidelity_reference:
    input:
        plan=rules.extract_plan.output.plan,
        dataset=rules.prepare.output.dataset,
        target=TARGET,
    output:
        record=result(f"fidelity/{REFERENCE_RECORD}"),
        states=result(f"fidelity/{REFERENCE_STATES}"),
    log:
        log_path("fidelity_reference"),
    benchmark:
        benchmark_path("fidelity_reference")
    conda:
        CONDA_ENV
    resources:
        gpu=FIDELITY_JOBS["fidelity_reference"][0],
    params:
        depends=depends_on("fidelity_reference"),
        code=code_version("fidelity_reference"),
        setting=config["extract"]["fidelity"],
        device=config["device"],
        device_memory_gb=config["extract"]["fidelity_device_memory_gb"],
        samples=config["extract"]["fidelity_samples"],
        backend_options=extract_backend_options(),
        temperature=config["generate"]["temperature"],
        greedy_minimum=greedy_agreement_minimum(),
    script:
        "../scripts/fidelity_reference.py"


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
        depends=depends_on("extract_server"),
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
        depends=depends_on("extract"),
        code=code_version("extract_gather"),
    script:
        "../scripts/extract_gather.py"


rule fidelity:
    input:
        plan=rules.extract_plan.output.plan,
        dataset=rules.prepare.output.dataset,
        target=TARGET,
        reference=rules.fidelity_reference.output.record,
        reference_states=rules.fidelity_reference.output.states,
        extracted=(
            rules.extract.output.summary if vllm_states_from_extraction(config) else []
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
        gpu=FIDELITY_JOBS["fidelity"][0],
    params:
        depends=depends_on("fidelity"),
        code=code_version("fidelity"),
        tolerance=fidelity_tolerance(
            config["extract"]["fidelity_tolerance"][config["target"]["dtype"]],
            config["extract"]["storage"],
        ),
        backend_options=extract_backend_options(),
    script:
        "../scripts/fidelity.py"
