"""What a run leaves in its working directory: names, the stages and their folders.

The one module that spells them (the extraction's own files inside ``hidden_states/``
are draftflow.extract.layout's); standard library only, so the plan and the progress
check import it without torch::

    results/<run>/run_plan.json, run_plan.md   the run's plan, written as it starts
    results/<run>/<folder>/                    each stage's outputs (STAGES)
    results/<run>/provenance.json              what ran, on what
    logs/<run>/<rule>.log                      each job's log
    benchmarks/<run>/<rule>.tsv                each job's benchmark (extract_server-<s>.tsv)

``python -m draftflow.run_folder`` (``make clean``) deletes them, keeping what a real
target spent its GPU-hours on (COSTLY) unless told ``--all``.
"""

from __future__ import annotations

import argparse
import shutil
from dataclasses import dataclass
from pathlib import Path

RESULTS, LOGS, BENCHMARKS = "results", "logs", "benchmarks"
RUN_PLAN, RUN_PLAN_TEXT = "run_plan.json", "run_plan.md"
PROVENANCE = "provenance.json"
HIDDEN_STATES = "hidden_states"
UNTRAINED_DRAFTER, TRAINING_VIEWS, TRAINING_WORK = "drafter_untrained", "training_data", "train"
TRAINED_DRAFTER = "drafter_trained"  # train's output; DRAFTER, the drafter as it ships, links to its files
DRAFTER = "drafter"
EVALUATION, REPORT, PILOT = "evaluation", "report", "pilot"
DEMO_TARGET_RULE = "demo_target"  # builds resources/, outside any run


@dataclass(frozen=True)
class Stage:
    rule: str
    folders: tuple[str, ...]  # under results/<run>/
    host_memory_mb: int  # per job, from the demo's benchmarks (max RSS, rounded up)
    per_server: bool = False  # one job per server (generate.servers, extract.servers): <rule>-<s>

    def benchmark_names(self, servers: dict[str, int]) -> list[str]:
        """``servers``: the job count of each per-server stage, by rule."""
        return [f"{self.rule}-{s}" for s in range(servers[self.rule])] if self.per_server else [self.rule]


STAGES = (
    Stage("prompts", ("prompts",), 1000),
    Stage("generate_server", ("synthetic",), 5000, per_server=True),
    Stage("generate", ("synthetic",), 1000),
    Stage("prepare", ("prepared",), 2000),
    Stage("vocab_map", ("vocab",), 1000),
    Stage("extract_plan", (HIDDEN_STATES,), 1000),
    Stage("fidelity_reference", ("fidelity",), 2000),
    Stage("extract_server", (HIDDEN_STATES,), 5000, per_server=True),
    Stage("extract", (HIDDEN_STATES,), 1000),
    Stage("fidelity", ("fidelity",), 5000),
    Stage("drafter_init", (UNTRAINED_DRAFTER,), 2000),
    Stage("train_views", (TRAINING_VIEWS,), 1000),
    Stage("train", (TRAINING_WORK, TRAINED_DRAFTER), 2000),
    Stage("evaluate", (EVALUATION,), 1000),
    Stage("serve_check", (EVALUATION,), 4000),
    Stage("pilot", (PILOT,), 2000),
    Stage("report", (REPORT,), 1000),
    Stage("provenance", (), 1000),
    Stage("model_card", (DRAFTER,), 1000),
)
STAGE = {stage.rule: stage for stage in STAGES}
DEMO_TARGET_MEMORY_MB = 2000


def host_memory_resources() -> dict[str, dict[str, int]]:
    """Host memory per rule: the local profile's set-resources."""
    memory = {DEMO_TARGET_RULE: DEMO_TARGET_MEMORY_MB, **{s.rule: s.host_memory_mb for s in STAGES}}
    return {rule: {"mem_mb": mb} for rule, mb in memory.items()}


def stages_before_report(serve_check: bool, pilot: bool = False) -> list[Stage]:
    """The stages whose benchmarks the report sums and whose inputs provenance
    records, in order (serve_check and pilot where the config runs them)."""
    runs = {"serve_check": serve_check, "pilot": pilot}
    return [s for s in STAGES if s.rule not in ("report", "provenance", "model_card") and runs.get(s.rule, True)]


def result(run: str, path: str) -> str:
    return f"{RESULTS}/{run}/{path}"


def log_path(run: str, rule: str, name: str = "log") -> str:
    return f"{LOGS}/{run}/{rule}.{name}"


def benchmark_path(run: str, name: str) -> str:
    return f"{BENCHMARKS}/{run}/{name}.tsv"


def benchmarks_dir(run_dir: Path) -> Path:
    """``benchmarks/<run>`` beside ``results/<run>``."""
    return run_dir.parents[1] / BENCHMARKS / run_dir.name


def stage_of_benchmark(path: Path) -> str:
    """extract_server-3.tsv → extract_server: a stage's jobs are summed into one row."""
    return path.stem.split("-")[0]


def stage_dir(run_dir: Path, rule: str) -> Path:
    """Where ``rule`` writes under ``results/<run>`` (its first folder)."""
    return run_dir / STAGE[rule].folders[0]


def hidden_states_dir(run_dir: Path) -> Path:
    return run_dir / HIDDEN_STATES


ANSWER_STORES = "synthetic/work"  # draftflow.answers' files: every answer generation got
# Kept by a clean unless told: a rerun asks no stored answer again and extracts no
# journaled sample again, however Snakemake's records were lost.
COSTLY = (ANSWER_STORES, HIDDEN_STATES)


def clean(workdir: Path, everything: bool) -> list[Path]:
    """Delete every run's results, logs and benchmarks and Snakemake's records in
    ``workdir``, but, unless ``everything``, each run's COSTLY folders: those kept."""
    results = workdir / RESULTS
    kept = [] if everything else sorted(path for run in results.glob("*") for name in COSTLY if (path := run / name).exists())
    if results.exists():
        prune(results, set(kept))
    for name in (LOGS, BENCHMARKS, ".snakemake"):
        shutil.rmtree(workdir / name, ignore_errors=True)
    return kept


def prune(folder: Path, kept: set[Path]) -> None:
    """Delete what ``folder`` holds but the ``kept`` paths and the folders leading to them."""
    for child in folder.iterdir():
        if child in kept:
            continue
        if any(child in path.parents for path in kept):
            prune(child, kept)
        elif child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make clean", description="Delete the runs of this working directory.")
    parser.add_argument("--all", action="store_true", help="the answer stores and hidden states too")
    kept = clean(Path.cwd(), parser.parse_args(argv).all)
    for path in kept:
        print(f"kept {path} (make clean ALL=1 deletes it)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
