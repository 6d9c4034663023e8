localrules:
    report,


rule report:
    input:
        benchmarks=[
            benchmark_path(name)
            for stage in run_folder.stages_before_report(SERVE_CHECK, PILOT)
            for name in stage.benchmark_names(SERVER_JOBS)
        ],
        prompts=rules.prompts.output.stats,
        generate=rules.generate.output.stats,
        prepare=rules.prepare.output.stats,
        coverage=rules.vocab_map.output.coverage,
        extract=rules.extract.output.summary,
        fidelity=rules.fidelity.output.report,
        train=rules.train.output.stats,
        evaluation=rules.evaluate.output.evaluation,
        served=rules.serve_check.output.served if SERVE_CHECK else [],
        pilot=rules.pilot.output.pilot if PILOT else [],
    output:
        runtimes=report(
            result("report/stage_runtimes.tsv"),
            caption="../report/stage_runtimes_table.rst",
            category="Runtime",
        ),
        plot=report(
            result("report/stage_runtimes.png"),
            caption="../report/stage_runtimes.rst",
            category="Runtime",
        ),
        sets_plot=report(
            result("report/acceptance_by_set.png"),
            caption="../report/acceptance_by_set.rst",
            category="Evaluation",
        ),
        epochs_plot=report(
            result("report/epochs.png"),
            caption="../report/epochs.rst",
            category="Training",
        ),
        markdown=report(
            result("report/report.md"),
            caption="../report/summary.rst",
            category="Summary",
        ),
    log:
        log_path("report"),
    benchmark:
        benchmark_path("report")
    conda:
        CONDA_ENV
    params:
        depends=depends_on("report"),
        code=code_version("report"),
        run=RUN,
        compared={run: f"results/{run}" for run in config["report"]["compare_runs"]},
    script:
        "../scripts/report.py"
