rule demo_target:
    output:
        model=directory(DEMO_TARGET),
        prompts="resources/demo-prompts.jsonl",
    log:
        "logs/demo_target.log",
    benchmark:
        "benchmarks/demo_target.tsv"
    conda:
        CONDA_ENV
    params:
        code=code_version("demo_target"),
        seed=0,
        prompt_count=300,
    script:
        "../scripts/demo_target.py"
