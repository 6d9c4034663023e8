rule vocab_map:
    input:
        token_freq=rules.prepare.output.token_freq,
        target=TARGET,
    output:
        d2t=result("vocab/d2t.npy"),
        t2d=result("vocab/t2d.npy"),
        coverage=result("vocab/coverage.json"),
        plot=report(result("vocab/coverage.png"), category="Vocabulary"),
    log:
        log_path("vocab_map"),
    benchmark:
        benchmark_path("vocab_map")
    conda:
        CONDA_ENV
    params:
        code=code_version("vocab_map"),
        draft_vocab_size=config["vocab"]["draft_vocab_size"],
        coverage_sizes=config["vocab"]["coverage_sizes"],
    script:
        "../scripts/vocab_map.py"
