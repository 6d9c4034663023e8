"""``draftflow pilot --configfile FILE``: the workflow run at ``pilot.num_samples`` with the pilot
on (rule ``pilot``), then the fit (``draftflow.pilot``) printed beside the plan's cost of the run
at each size it predicts."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from draftflow.config import load_config, merged
from draftflow.io import read_json
from draftflow.pilot import PILOT_FILE, summary_lines

PILOT_SHARE = 8  # pilot.num_samples null: this share of data.num_samples


def pilot_num_samples(config: dict) -> int:
    return config["pilot"]["num_samples"] or max(1, config["data"]["num_samples"] // PILOT_SHARE)


def pilot_overlay(config: dict) -> dict:
    """What the pilot's run changes of ``config``: its data.num_samples, the pilot on, and the
    configured data.num_samples among the sizes predicted."""
    predict_for = sorted({*config["pilot"]["predict_for"], config["data"]["num_samples"]})
    return {"data": {"num_samples": pilot_num_samples(config)}, "pilot": {"enabled": True, "predict_for": predict_for}}


def plan_lines(config: dict, run_dir: Path, pilot: dict) -> list[str]:
    """The plan's cost of the run at each size predicted, from the pilot run's measured rates
    (what it would still ask and extract: the pilot's samples are reused)."""
    from draftflow.plan import build_plan, rates_from_run
    from draftflow.units import fmt_bytes, fmt_duration

    rates = rates_from_run(run_dir)
    lines = ["| data.num_samples | predicted mean acceptance length | 90% interval | plan: samples (evaluation sets included) "
             "| time | GPU-hours | disk at peak |", "| ---: | ---: | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    warnings = []
    for p in pilot["predictions"]:
        plan = build_plan(merged(config, {"data": {"num_samples": p["num_samples"]}}), run_dir, rates)
        predicted = "no fit" if p["predicted"] is None else f"{p['predicted']:.3f}"
        interval = "" if p["interval"] is None else f"{p['interval'][0]:.3f} to {p['interval'][1]:.3f}"
        lines.append(f"| {p['num_samples']} | {predicted} | {interval} | {plan.tokens['samples']} | {fmt_duration(plan.total_seconds)} | "
                     f"{plan.total_gpu_hours:.1f} | {fmt_bytes(plan.peak_bytes)} |")  # fmt: skip
        warnings += [f"The plan of data.num_samples {p['num_samples']} warns: {warning}" for warning in plan.warnings]
    return [*lines, "", *warnings] if warnings else lines


def snakefile_args() -> list[str]:
    """The checkout's Snakefile where draftflow runs from one (as the README's commands do),
    else none: Snakemake looks in the current folder."""
    snakefile = Path(__file__).parents[1] / "Snakefile"
    return ["--snakefile", str(snakefile)] if snakefile.exists() else []


def main(argv: list[str] | None = None, prog: str = "draftflow pilot") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run the workflow at pilot.num_samples with the pilot on (drafters on nested fractions of its "
                    "training samples), then print what the fit predicts at the configured data.num_samples, "
                    "beside the plan's cost of that run.",  # fmt: skip
        epilog="Arguments after -- go to Snakemake. The later run at data.num_samples reuses the pilot's answers and hidden states.",
    )
    parser.add_argument("--configfile", type=Path, nargs="+", action="extend", required=True, metavar="FILE",
                        help="the run's config file(s), as Snakemake takes them (later files over earlier ones)")  # fmt: skip
    parser.add_argument("--directory", type=Path, default=Path.cwd(), help="the workflow's working directory (default: here)")
    parser.add_argument("--cores", default="all", help="Snakemake's --cores (default: all)")
    parser.add_argument("snakemake_args", nargs=argparse.REMAINDER, help="after --: more Snakemake options (the targets are the pilot's)")
    args = parser.parse_args(argv)
    from draftflow import run_folder

    config = load_config(*args.configfile)
    overlay = pilot_overlay(config)
    extra = [a for a in args.snakemake_args if a != "--"]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="pilot-") as file:
        yaml.safe_dump(overlay, file)
        file.flush()
        command = [sys.executable, "-m", "snakemake", *snakefile_args(),
                   "--directory", str(args.directory), "--cores", args.cores,
                   "--configfile", *map(str, args.configfile), file.name, *extra,
                   "--", "all", run_folder.result(config["run"], PILOT_FILE)]  # fmt: skip
        print(f"pilot: the run at data.num_samples {overlay['data']['num_samples']}: {' '.join(command)}", flush=True)
        if code := subprocess.run(command).returncode:
            return code
    run_dir = args.directory / run_folder.result(config["run"], "")
    pilot = read_json(run_dir / PILOT_FILE)
    print("\n".join(["", f"# What more data buys: run {config['run']}", "", *summary_lines(pilot), "",
                     *plan_lines(config, run_dir, pilot), ""]))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
