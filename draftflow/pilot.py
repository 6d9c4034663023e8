"""What more data buys (issue 59): drafters trained on nested fractions of a run's training
samples, each measured along the decoding replay on the same held-out requests, and a
saturating curve through them (``draftflow.pilot_fit``) that predicts larger runs.

The fractions train at matched epochs, not matched steps: each trains with the run's own
recipe (train.epochs, its learning rate and schedule, the best epoch shipped as the run's
drafter is), as a user trains each size, so the curve says what the same recipe buys on more
data; at matched steps a small fraction would pass over its few samples many times more than
the run does, and the curve would mix data with repetition. The largest fraction, 1, is the
run's own drafter. The held-out requests are those the run's decoding replay walks
(evaluate.serve_check_requests), at the temperature the answers were sampled at, so the last
point is the evaluation's own figure.

``draftflow pilot --configfile FILE`` runs the workflow at ``pilot.num_samples`` with the
pilot on, then prints the fit beside the plan's cost of the run at each size it predicts.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tempfile
from copy import deepcopy
from pathlib import Path

import yaml

from draftflow.io import read_json, write_json

PILOT_FILE = "pilot/pilot.json"
INTERVAL = 0.9  # the bootstrap interval's level
PILOT_SHARE = 8  # pilot.num_samples null: this share of data.num_samples


def fraction_rows(train_rows: int, fractions: list[float]) -> list[int]:
    """Rows each fraction trains on (at least one each), smallest first, without repeats."""
    return sorted({max(1, round(fraction * train_rows)) for fraction in fractions})


def replayed_requests(drafter, head, heldout_view: Path, samples: list, selection) -> tuple[list[int], list[int]]:
    """Drafts and accepted tokens per held-out request along the decoding replay, as the
    evaluation counts them (``draftflow.evaluate.measure``) at the selection's K and sampling."""
    from draftflow.evaluate import measure

    k = selection.draft_tokens
    acceptance = measure(drafter, head, heldout_view, samples, [k], len(samples), selection.max_tokens,
                         selection.sampling, selection.sampled_at)[""]  # fmt: skip
    steps = acceptance.replayed[k]
    return [int(s.numel()) for s in steps], [int(s.sum()) for s in steps]


def train_fractions(init_dir: Path, train_view: Path, trained: Path, settings, scorer, work_dir: Path,
                    fractions: list[float]) -> dict[int, Path]:  # fmt: skip
    """Each fraction's drafter folder by its training rows: the smaller ones trained here (each
    on a prefix of the training view, made again each time, so that edited data or settings
    train anew while a finished training key resumes at its end), the whole view's the run's."""
    from draftflow.train import train_drafter
    from draftflow.training_data import check_view, prefix_view

    total = check_view(train_view)
    drafters = {}
    for rows in fraction_rows(total, fractions):
        if rows == total:
            drafters[rows] = trained
            continue
        folder = work_dir / f"rows-{rows}"
        prefix_view(train_view, rows, folder / "view")
        print(f"pilot: {rows} of {total} training samples")
        train_drafter(init_dir, folder / "view", settings, folder / "work", folder / "drafter", scorer)
        drafters[rows] = folder / "drafter"
    return drafters


def fit_points(points, train_share: float, predict_for: list[int], target_tau: float | None, draws: int, seed: int) -> dict:
    """The fit through ``points`` (``pilot_fit.Replayed``), its interval at each size of
    ``predict_for`` (data.num_samples; training samples = ``train_share`` of them), the back-test
    and what speaks against trusting it."""
    from draftflow.pilot_fit import back_test, bootstrap, fit_saturating, trust_problems

    fit = fit_saturating([p.samples for p in points], [p.tau() for p in points])
    sizes = {n: n * train_share for n in predict_for}
    interval = bootstrap(points, list(sizes.values()), draws, seed, INTERVAL) if fit else {}
    predictions = [{"num_samples": n, "training_samples": round(m), "predicted": fit.predict(m) if fit else None,
                    "interval": list(interval[m]) if fit else None} for n, m in sizes.items()]  # fmt: skip
    needed = None
    if fit and target_tau is not None:
        samples = fit.samples_for(target_tau)
        needed = {"acceptance_length": target_tau, "training_samples": samples,
                  "num_samples": samples / train_share if math.isfinite(samples) else samples}  # fmt: skip
    return {
        "fit": None if fit is None else {"ceiling": fit.ceiling, "scale": fit.scale, "exponent": fit.exponent,
                                         "rms_error": fit.rms_error, "formula": "tau(n) = ceiling - scale * n^-exponent"},  # fmt: skip
        "interval_level": INTERVAL,
        "predictions": predictions,
        "back_test": back_test(points),
        "trust_problems": trust_problems(points, fit),
        "needed": needed,
    }


def pilot_result(points, train_share: float, num_samples: int, settings: dict) -> dict:
    """pilot.json: the points (training samples, τ, per-request drafts and accepted) and the fit."""
    fitted = fit_points(points, train_share, settings["predict_for"], settings["target_acceptance_length"],
                        settings["bootstrap_draws"], settings["seed"])  # fmt: skip
    return {"num_samples": num_samples, "train_share": train_share,
            "points": [{"training_samples": p.samples, "mean_acceptance_length": p.tau(), "drafts": p.drafts, "accepted": p.accepted}
                       for p in points], **fitted}  # fmt: skip


def summary_lines(pilot: dict) -> list[str]:
    """The pilot in Markdown: the points, the back-test, the predictions and the warnings."""
    lines = ["| training samples | mean acceptance length (decoding replay) |", "| ---: | ---: |"]
    lines += [f"| {p['training_samples']} | {p['mean_acceptance_length']:.3f} |" for p in pilot["points"]]
    fit = pilot["fit"]
    if fit is None:
        lines += ["", "No saturating curve fits these points."]
    else:
        lines += ["", f"Fit: τ(n) = {fit['ceiling']:.3f} − {fit['scale']:.3f}·n^−{fit['exponent']:.2f} "
                      f"(n: training samples; rms error {fit['rms_error']:.3f} at its points)."]  # fmt: skip
    if back := pilot["back_test"]:
        lines.append(f"Back-test: fitted on all but the largest point, it predicts {back['predicted']:.3f} at {back['samples']} "
                     f"training samples, where {back['measured']:.3f} was measured: error {back['error']:+.3f}.")  # fmt: skip
    level = round(100 * pilot["interval_level"])
    for p in pilot["predictions"]:
        if p["predicted"] is not None:
            low, high = p["interval"]
            lines.append(f"At data.num_samples {p['num_samples']} ({p['training_samples']} training samples): "
                         f"{p['predicted']:.3f}, {level}% interval {low:.3f} to {high:.3f}.")  # fmt: skip
    if needed := pilot["needed"]:
        count = "never (at or above the curve's ceiling)" if not math.isfinite(needed["num_samples"]) else f"about {needed['num_samples']:,.0f}"
        lines.append(f"Mean acceptance length {needed['acceptance_length']} needs data.num_samples {count}.")
    lines += [f"Not to be trusted as it stands: {problem}." for problem in pilot["trust_problems"]]
    return lines


def plot_pilot(pilot: dict, output: Path) -> None:
    """The points, the fit out to the largest size predicted and its interval there."""
    from draftflow.pilot_fit import SaturatingFit
    from draftflow.plots import pyplot, save_png

    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 4))
    samples = [p["training_samples"] for p in pilot["points"]]
    axis.plot(samples, [p["mean_acceptance_length"] for p in pilot["points"]], "o", label="measured (decoding replay)")
    if fit := pilot["fit"]:
        curve = SaturatingFit(fit["ceiling"], fit["scale"], fit["exponent"], fit["rms_error"])
        end = max([*samples, *(p["training_samples"] for p in pilot["predictions"])])
        grid = [samples[0] * (end / samples[0]) ** (i / 99) for i in range(100)]
        axis.plot(grid, [curve.predict(n) for n in grid], "-", label=f"fit, ceiling {fit['ceiling']:.2f}")
        for p in pilot["predictions"]:
            low, high = p["interval"]
            axis.errorbar([p["training_samples"]], [p["predicted"]], yerr=[[p["predicted"] - low], [high - p["predicted"]]],
                          fmt="s", capsize=4, label=f"predicted at {p['num_samples']} samples ({round(100 * pilot['interval_level'])}%)")  # fmt: skip
    axis.set(xscale="log", xlabel="training samples", ylabel="mean acceptance length",
             title="What more data buys (pilot)")  # fmt: skip
    axis.xaxis.set_major_formatter(lambda value, _: f"{value:g}")
    axis.xaxis.set_minor_formatter(lambda value, _: "")
    axis.legend(fontsize="small")
    save_png(figure, output)


def run_pilot(init_dir: Path, train_view: Path, heldout_view: Path, trained: Path, target: Path, generation_stats: Path,
              settings: dict, selection: dict, requests: int, num_samples: int, pilot: dict, work_dir: Path,
              output: Path, plot: Path) -> dict:  # fmt: skip
    """The pilot rule: the fractions' drafters (``settings``: TrainSettings' fields), each measured on
    the first ``requests`` held-out samples as the evaluation's replay is, the fit, pilot.json and its plot."""
    from draftflow.epoch_selection import Selection, epoch_scorer
    from draftflow.evaluate import TargetHead, evaluation_samples
    from draftflow.pilot_fit import Replayed
    from draftflow.prompt_sources import HELDOUT
    from draftflow.train import TrainSettings, load_drafter

    trainer = TrainSettings(**settings)
    served = Selection.as_served(read_json(generation_stats)["sampling"], **selection)
    scorer = epoch_scorer(served, trainer.selection_samples, target, heldout_view, trainer.device, trainer.attention)
    drafters = train_fractions(init_dir, train_view, trained, trainer, scorer, work_dir, pilot["fractions"])
    head = scorer.head if scorer else TargetHead(target, trainer.device)
    samples = evaluation_samples(heldout_view)[HELDOUT][:requests]
    points = []
    for rows, folder in drafters.items():
        drafter = load_drafter(folder, trainer.attention).to(trainer.device)
        points.append(Replayed(rows, *replayed_requests(drafter, head, heldout_view, samples, served)))
    result = pilot_result(points, max(drafters) / num_samples, num_samples, {**pilot, "seed": settings["seed"]})
    write_json(output, result)
    plot_pilot(result, plot)
    print("\n".join(summary_lines(result)))
    return result


# -- draftflow pilot ---------------------------------------------------------------


def pilot_num_samples(config: dict) -> int:
    return config["pilot"]["num_samples"] or max(1, config["data"]["num_samples"] // PILOT_SHARE)


def pilot_overlay(config: dict) -> dict:
    """What the pilot's run changes of ``config``: its data.num_samples, the pilot on, and the
    configured data.num_samples among the sizes predicted."""
    predict_for = sorted({*config["pilot"]["predict_for"], config["data"]["num_samples"]})
    return {"data": {"num_samples": pilot_num_samples(config)}, "pilot": {"enabled": True, "predict_for": predict_for}}


def merged(config: dict, overlay: dict) -> dict:
    out = deepcopy(config)
    for section, values in overlay.items():
        out[section] = {**out[section], **values}
    return out


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
    from draftflow.config import load_config

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
